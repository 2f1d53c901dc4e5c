"""Pieces shared by every kvroute service: HTTP plumbing and the built-in offline tokenizer."""
