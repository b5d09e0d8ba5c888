"""Backends run training jobs. One protocol (`base.Backend`), one module per backend."""
