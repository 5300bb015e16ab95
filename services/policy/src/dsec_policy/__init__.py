"""DSec package."""
