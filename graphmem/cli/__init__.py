"""Stage 7: the command line.  Parsing and exit codes only; the only package that imports click.

Input: argv.  Output: text or JSON on stdout (or --output), files, an exit code.  Every option
that says what is analysed is one shared group (``graphmem.cli.options.job_options``) parsed
into one ``graphmem.job.Job``.
"""

from __future__ import annotations

from graphmem.cli.commands import main

__all__ = ["main"]
