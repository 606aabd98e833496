"""``python -m graphmem`` hands over to the command line."""

from graphmem.cli import main

main()
