"""The step drivers: what runs under the recorder, as a trainer runs it.

Input: a model with fake parameters, fake inputs and the step configuration.  Output: the ops
of inference, a training step (micro-steps, loss, backward, optimizer step), checkpointing or
generation, run under the recorder.  Knows nothing of liveness, categories or reports.
"""
