"""kvroute slot_tracker."""
