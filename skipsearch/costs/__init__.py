"""The profiler: times this device's forwards and what decoding pays besides them, and fills a cost profile (its data
type lives low, in decode/cost_profile.py, so that readers of a profile do not import the profiler)."""
