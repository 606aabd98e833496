"""The recording core: the dispatch mode that sees every aten op, and its books.

Input: ops as the dispatcher runs them on fake tensors.  Output: op records, storages with
their creation and release, the fx graph and each op's module path.  Knows no training step,
no parallel engine, no value assumption and no target GPU: those are told to it.
"""
