"""Configuration: scenarios (YAML loading, overrides, validation), hardware presets and
profiles, and the error type every bad input raises."""
