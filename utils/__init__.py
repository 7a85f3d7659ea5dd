"""Library code of the entry points: data/, train/ and eval/ sub-packages plus shared config, CLI and rank helpers."""
