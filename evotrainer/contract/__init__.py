"""What every backend agrees on, below the engine and the backends that run it: the recipe
contract (`recipe.py`: `check_recipe`, `check_contract`, the evaluation sampling) and the group
filters (`filters.py`) the embedded engine, verl's sampler and the backtests all apply, so the
gate, the verl renderer and the replay never reach into `engine/`."""
