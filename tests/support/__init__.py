"""Helpers shared by several test packages: reference models and checkpoints, kernel checks, test cases."""
