"""What every stage's process shares: Ctrl-C and signals checked between steps (interrupts),
progress lines on stderr (progress), and worker processes that record side by side (workers).
Below every stage; imports nothing of graphmem but its errors."""
