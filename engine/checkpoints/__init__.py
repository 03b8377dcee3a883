"""checkpoints: see ARCHITECTURE.md."""
