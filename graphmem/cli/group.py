"""The ``graphmem`` command group, light: ``graphmem --help`` and ``--version`` import no torch.

The commands themselves (graphmem.cli.commands, which imports the analysis and so torch) are
imported the first time one is asked for: by name to run it, or by ``--help`` for a command.
The group's own ``--help`` lists them from ``FIRST_PARAGRAPH``, which a test keeps equal to
each command's own help, so the listing is click's.
"""

from __future__ import annotations

import importlib

import click

from graphmem import __version__
from graphmem.cli.process import GraphmemGroup
from graphmem.job.option import spelling

__all__ = ["FIRST_PARAGRAPH", "main"]

# each command's help, its first paragraph (tests/unit/cli/test_cli_startup.py keeps it each command's own)
FIRST_PARAGRAPH = {
    "analyze": "Analyse TARGET (pkg.module:Attr or path/file.py:Attr): peaks of inference and training.",
    "check": "Will TARGET fit the budget? Exit 0: the predicted peak with --margin fits (on a GPU: the caching "
             "allocator's reserved peak plus the CUDA context and NCCL buffers); 1: it does not; 2: usage error; "
             "3: the analysis failed; 130: interrupted.",
    "max-batch": "The largest batch (max-batch) or sequence length (max-seq) that fits: the dimension written as a "
                 f"capital letter in {spelling('inputs')} (Bx1000, 1xSx64). N fits and N+1 does not, both analysed. "
                 "Exit 0 when "
                 "some value fits, 1 when even 1 does not.",
    "max-seq": "The largest batch (max-batch) or sequence length (max-seq) that fits: the dimension written as a "
               f"capital letter in {spelling('inputs')} (Bx1000, 1xSx64). N fits and N+1 does not, both analysed. "
               "Exit 0 when "
               "some value fits, 1 when even 1 does not.",
    "plan": "What to change so TARGET fits: each remedy (batch, checkpointing, autocast, optimizer, accumulation, "
            "ZeRO/FSDP, offload, quantization, pruning) alone and combined, ranked, with its predicted peak, saving "
            "and extra compute; and why training takes N times inference. With --policy: which blocks to checkpoint "
            "for the least recompute that fits (with --policy-save OPS, also which of them keep those ops' "
            "outputs).",
    "run": "Run a training program, unchanged, and predict its memory: graphmem run [OPTIONS] SCRIPT.py [ARGS]...",
}


class LazyGraphmemGroup(GraphmemGroup):
    """``GraphmemGroup`` whose commands are imported when one is asked for."""

    def _commands(self) -> None:
        importlib.import_module("graphmem.cli.commands")  # registers every command on this group

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(FIRST_PARAGRAPH) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            self._commands()
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click's, from each command's first paragraph where the command is not loaded."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, self.commands[name].get_short_help_str(limit) if name in self.commands
                 else click.Command(name, help=FIRST_PARAGRAPH[name]).get_short_help_str(limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGraphmemGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="graphmem")
def main() -> None:
    """Predict the memory of a PyTorch training step before it runs.

    The model is built on the meta device (no weights are allocated); the real step
    (forward, autograd backward, optimizer) is recorded as a graph of aten ops on fake
    tensors, and a storage-aware liveness pass gives the live bytes after every op.

    Exit codes (docs/exit-codes.md): 0 success (check: fits), 1 does not fit (check, max-batch,
    max-seq), 2 usage error, 3 the analysis failed or --timeout passed, 129 / 130 / 143 ended by
    SIGHUP / SIGINT (Ctrl-C) / SIGTERM, 141 stdout closed.
    """


