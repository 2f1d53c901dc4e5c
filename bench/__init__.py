"""kvroute bench."""
