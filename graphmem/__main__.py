"""``python -m graphmem`` hands over to the command line (its supervising process)."""

from graphmem.cli.supervisor import main

main()
