"""kvroute frontend."""
