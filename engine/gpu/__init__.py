"""gpu: see ARCHITECTURE.md."""
