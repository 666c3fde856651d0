"""The outside world: models by name, folder or GGUF file; calibration prompts; files written atomically; errors in
one line and which of them mean a resource ran out; a device's free memory. Of the rest of skipsearch it imports
constants.py alone."""
