"""kvroute indexer."""
