"""Skills: a skill, its trigger and its patch (skill.py), the workspace's library with a shared
repository's and the evidence recorded on them (library.py), and backtests replaying a skill's
reward or group filter over stored rollouts (replay.py). The built-in skills themselves are data:
the repository's top-level skills/ folder (store/builtin.py)."""
