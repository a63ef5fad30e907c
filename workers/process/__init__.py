"""Worker processes: the supervisor that starts and replaces them, each child's entry point, pinning."""
