"""Generation backends shipped with the core, registered through the grpo_plugins entry point."""
