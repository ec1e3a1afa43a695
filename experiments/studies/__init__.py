"""The reproduction study's presets, statistics and plots (programs/study.py)."""
