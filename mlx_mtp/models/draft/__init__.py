"""The draft-only output head and the draft vocabulary (its ranking file and run-time tuner)."""
