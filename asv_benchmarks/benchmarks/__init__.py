"""asv benchmark suites of safetensors-engine; data generators live in ``common``."""
