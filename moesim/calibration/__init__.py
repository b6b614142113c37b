"""Calibration: measure a device, fit a hardware profile, validate the simulator against a
reference executor that replays its decisions."""
