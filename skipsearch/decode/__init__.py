"""Self-speculative decoding, from transformers' internals up: the adapter (adapter.py), the static cache rolled back
by position (kvcache.py), the draft path per skip set (skipset.py, skipping.py), the steps (steps.py) and the engine
that makes and keeps them (engine.py; compiled: regional.py, fused.py), the verification's packed head on a CPU
(packed.py), the draft controller and its economics, the choice among skip sets, the loop (loop.py with rounds,
sampling, stats), its argument checks, `custom_generate`, and the plain data types the layers above read: the draft
policy, the skip config and the cost profile."""
