from evotrainer.store.recipe import BASE_RECIPE, deep_merge, digest, resolve, set_dotted


def test_mappings_merge_recursively_and_null_removes():
    merged = deep_merge({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 10}, "d": None})
    assert merged == {"a": {"b": 10, "c": 2}}


def test_named_lists_merge_by_name_other_lists_replace():
    base = {"components": [{"name": "correctness", "weight": 1.0}], "seeds": [0, 1]}
    override = {"components": [{"name": "correctness", "weight": 0.5},
                               {"name": "format", "weight": 0.1}], "seeds": [7]}
    merged = deep_merge(base, override)
    assert merged["components"] == [{"name": "correctness", "weight": 0.5},
                                    {"name": "format", "weight": 0.1}]
    assert merged["seeds"] == [7]


def test_resolve_applies_project_then_chain_root_to_leaf():
    recipe = resolve({"grpo": {"lr": 3e-4}}, [{"grpo": {"steps": 5}}, {"grpo": {"lr": 1e-5}}])
    assert recipe["grpo"]["lr"] == 1e-5 and recipe["grpo"]["steps"] == 5
    assert recipe["grpo"]["group_size"] == BASE_RECIPE["grpo"]["group_size"]
    assert BASE_RECIPE["grpo"]["lr"] == 1e-4  # the base is never mutated


def test_digest_is_canonical():
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})
    assert digest({}).startswith("sha256:")


def test_set_dotted_creates_parents():
    target: dict = {}
    set_dotted(target, "group_filter.params.keep_ratio", 0.9)
    assert target == {"group_filter": {"params": {"keep_ratio": 0.9}}}


def test_composed_overrides_keep_nulls_until_merged_onto_a_recipe():
    patch = deep_merge({"group_filter": {"name": "std_group_filter", "params": {"mode": "top_p"}}},
                       {"group_filter": {"name": "zero_std", "params": None}}, keep_nulls=True)
    assert patch == {"group_filter": {"name": "zero_std", "params": None}}
    recipe = resolve({"group_filter": {"name": "std_group_filter", "params": {"z": 1}}}, [patch])
    assert recipe["group_filter"] == {"name": "zero_std"}


# Digests computed on main at 1a23fc3, before the recipe became typed: approvals bind a
# version's resolved-recipe digest, so neither the defaults nor resolution may move them.
DEFAULT_DIGEST = "sha256:3fb948eb375aef5bf0f0f0fa1c4f4b996f3ead33ef7a788048400346aa0a4de6"
# The `recipe:` of evotrainer/examples/arith.yaml as it was then, with a version's override.
ARITH_PROJECT_RECIPE = {
    "backend": "local",
    "domain": {"name": "arith", "params": {"ops": ["+", "*"]}, "train_size": 160,
               "val_size": 40},
    "grpo": {"steps": 150, "lr": 3.0e-4, "eval_every": 50, "eval_k": 16},
}
ARITH_DIGEST = "sha256:d375950a47326d3a086327ae0e2e909fda79dd8b08f5616582a7655eb2eb9575"
ARITH_CHILD = {"grpo": {"lr": 1e-4}, "reward": {"components": [{"name": "format",
                                                                "weight": 0.1}]}}
ARITH_CHILD_DIGEST = "sha256:23b982e22e379290734606659a21d3fd5e3e872d7b0836b208ffb03439d5c5fb"


def test_resolved_recipe_digests_are_pinned():
    assert digest(resolve({}, [])) == DEFAULT_DIGEST
    assert digest(resolve(ARITH_PROJECT_RECIPE, [])) == ARITH_DIGEST
    assert digest(resolve(ARITH_PROJECT_RECIPE, [ARITH_CHILD])) == ARITH_CHILD_DIGEST
