"""kvroute mocker."""
