"""What people run: the command line, pictures, the pattern catalogue and the CPU demo."""
