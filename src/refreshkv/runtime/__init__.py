"""Running a model with a KV method: loading (loading.py; the named models, models.py), the runtime options
(prepare.py), the decode loop (generate.py) and its settings (generation_settings.py), compiled decode steps
(compiled.py) and the weight layout (weight_layout.py)."""
