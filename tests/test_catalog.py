from __future__ import annotations

import copy
import re

import pytest
import yaml

from usd.catalog import CatalogError, builtin_catalog_path, load_catalog, parse_catalog

MODELS_MD_SHA = {
    "smollm2-135m-instruct": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "qwen2.5-coder-0.5b-instruct": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "gemma-3-270m": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
}


@pytest.fixture()
def raw():
    return yaml.safe_load(builtin_catalog_path().read_text())


def test_builtin_catalog_loads_with_required_content():
    cat = load_catalog()
    assert (cat.default.target, cat.default.drafter) == ("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct")
    for name, sha in MODELS_MD_SHA.items():
        entry = cat.get(name)
        assert entry.source.kind == "pypi" and entry.source.sha256 == sha
        assert entry.trust_remote_code is False
    hub = [m for m in cat.models if m.source.kind == "hub"]
    assert len(hub) >= 12
    assert len({m.family for m in hub}) >= 6
    assert all(not m.trust_remote_code for m in cat.models)
    pairs = {(p.target, p.drafter) for p in cat.pairs}
    # the Universal Assisted Generation result pairs
    for pair in [
        ("codellama-13b-instruct", "tiny-starcoder-py"),
        ("gemma-2-9b", "vicuna-68m"),
        ("mixtral-8x22b-instruct", "qwen2.5-0.5b-instruct"),
        ("llama-3.1-70b", "qwen2.5-0.5b-instruct"),
        ("phi-3-medium-128k-instruct", "qwen2.5-0.5b-instruct"),
    ]:
        assert pair in pairs


def test_package_sizes_match_models_md():
    cat = load_catalog()
    assert cat.get("smollm2-135m-instruct").source.size == 98_362_432
    assert cat.get("qwen2.5-coder-0.5b-instruct").source.size == 491_400_064
    assert cat.get("gemma-3-270m").source.size == 253_113_024
    assert len(cat.get("qwen2.5-coder-0.5b-instruct").source.packages) == 6


def _error(data) -> str:
    with pytest.raises(CatalogError) as e:
        parse_catalog(data, "test.yaml")
    return str(e.value)


def test_unknown_field_names_entry_and_field(raw):
    raw["models"][1]["contxt_length"] = 5
    msg = _error(raw)
    assert "qwen2.5-coder-0.5b-instruct" in msg and "contxt_length" in msg and "unknown field" in msg


def test_missing_field_names_entry_and_field(raw):
    del raw["models"][0]["license"]
    msg = _error(raw)
    assert "smollm2-135m-instruct" in msg and "'license'" in msg and "missing" in msg


def test_bad_sha256_names_nested_field(raw):
    raw["models"][2]["source"]["sha256"] = "abc"
    msg = _error(raw)
    assert "gemma-3-270m" in msg and "source.sha256" in msg and "64 hex" in msg


def test_unknown_source_kind(raw):
    raw["models"][0]["source"]["kind"] = "ftp"
    msg = _error(raw)
    assert "smollm2-135m-instruct" in msg and "source" in msg and "ftp" in msg


def test_wrong_precision_value(raw):
    raw["models"][3]["precision"] = {"cuda": "int3", "cpu": "bf16"}
    msg = _error(raw)
    assert raw["models"][3]["name"] in msg and "precision.cuda" in msg


def test_trust_remote_code_must_be_bool(raw):
    raw["models"][4]["trust_remote_code"] = "maybe"
    msg = _error(raw)
    assert raw["models"][4]["name"] in msg and "trust_remote_code" in msg


def test_packages_and_files_must_pair_up(raw):
    raw["models"][1]["source"]["files"] = raw["models"][1]["source"]["files"][:3]
    msg = _error(raw)
    assert "qwen2.5-coder-0.5b-instruct" in msg and "6 packages but 3 files" in msg


def test_duplicate_names(raw):
    raw["models"].append(copy.deepcopy(raw["models"][0]))
    assert "appears twice" in _error(raw)


def test_default_and_pairs_must_name_catalog_models(raw):
    bad = copy.deepcopy(raw)
    bad["default"]["drafter"] = "nope"
    assert "default.drafter" in _error(bad) and "'nope'" in _error(bad)
    bad = copy.deepcopy(raw)
    bad["pairs"][0]["target"] = "ghost"
    assert "pairs[0].target" in _error(bad)


def test_bad_name_pattern(raw):
    raw["models"][0]["name"] = "Has Spaces"
    assert "field 'name'" in _error(raw)


def test_not_yaml_and_not_mapping(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("models: [unclosed")
    with pytest.raises(CatalogError, match="not valid YAML"):
        load_catalog(f)
    f.write_text("- just a list")
    with pytest.raises(CatalogError, match="expected a mapping"):
        load_catalog(f)


def test_user_file_adds_and_overrides(tmp_path, monkeypatch):
    f = tmp_path / "mine.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "my-local",
                        "family": "llama3",
                        "roles": ["drafter"],
                        "source": {"kind": "path", "path": "/somewhere/model"},
                        "context_length": 4096,
                        "license": "mit",
                        "chat_template": True,
                    }
                ],
                "pairs": [{"target": "qwen2.5-coder-0.5b-instruct", "drafter": "my-local", "why": "mine"}],
            }
        )
    )
    monkeypatch.setenv("USD_CHAT_MODELS", str(f))
    cat = load_catalog()
    assert cat.get("my-local").source.kind == "path"
    assert "smollm2-135m-instruct" in cat
    assert any(p.drafter == "my-local" for p in cat.pairs)


def test_user_file_error_names_user_file_and_entry(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "broken",
                        "family": "x",
                        "roles": ["boss"],
                        "source": {"kind": "path", "path": "/x"},
                        "context_length": 1,
                        "license": "mit",
                        "chat_template": False,
                    }
                ]
            }
        )
    )
    with pytest.raises(CatalogError) as e:
        load_catalog(user_path=f)
    assert str(f) in str(e.value) and "'broken'" in str(e.value) and "roles" in str(e.value)
    f.write_text(yaml.safe_dump({"modles": []}))
    with pytest.raises(CatalogError, match="unknown top-level key"):
        load_catalog(user_path=f)


def test_unknown_model_lookup_is_clear():
    with pytest.raises(KeyError, match="usd models"):
        load_catalog().get("gpt-5")


def test_user_file_duplicate_names_are_rejected_with_both_lines(tmp_path):
    entry = (
        "  - name: {name}\n    family: llama3\n    roles: [drafter]\n    source: {{kind: path, path: /x}}\n"
        "    context_length: 8\n    license: mit\n    chat_template: false\n"
    )
    f = tmp_path / "mine.yaml"
    f.write_text("models:\n" + entry.format(name="mine") + entry.format(name="other") + entry.format(name="mine"))
    with pytest.raises(CatalogError) as e:
        load_catalog(user_path=f)
    msg = str(e.value)
    assert str(f) in msg and "'mine'" in msg and "lines 2 and 16" in msg


def test_user_file_may_replace_a_builtin_entry_by_name(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "smollm2-135m-instruct",
                        "family": "mine",
                        "roles": ["drafter"],
                        "source": {"kind": "path", "path": "/x"},
                        "context_length": 8,
                        "license": "mit",
                        "chat_template": False,
                    }
                ]
            }
        )
    )
    cat = load_catalog(user_path=f)
    assert cat.get("smollm2-135m-instruct").family == "mine"
    assert cat.names().count("smollm2-135m-instruct") == 1


def test_builtin_duplicate_names_give_both_lines(tmp_path):
    text = builtin_catalog_path().read_text()
    f = tmp_path / "models.yaml"
    f.write_text(text.replace("name: gemma-3-270m\n", "name: smollm2-135m-instruct\n", 1))
    with pytest.raises(CatalogError, match=r"'smollm2-135m-instruct' appears twice.*lines \d+ and \d+"):
        load_catalog(f)


BAD_PACKAGES = [
    ("name", "--index-url=http://evil.example/simple"),
    ("name", "-e"),
    ("name", "pkg ; rm -rf"),
    ("name", "pkg-"),
    ("name", ""),
    ("name", "pkg\n"),
    ("version", "1.0 --pre"),
    ("version", "--no-deps"),
    ("version", "latest"),
    ("version", ">=1.0"),
    ("version", "1.0\n"),
]


@pytest.mark.parametrize(("field", "value"), BAD_PACKAGES)
def test_package_name_and_version_follow_the_registry_grammar(raw, field, value):
    raw["models"][0]["source"]["packages"][0][field] = value
    msg = _error(raw)
    assert "smollm2-135m-instruct" in msg and f"source.packages.0.{field}" in msg


def test_valid_package_names_and_versions_pass(raw):
    raw["models"][0]["source"]["packages"][0].update(name="A.b_c-9", version="1.0.post2.dev3+local.1")
    parse_catalog(raw, "test.yaml")


def test_readme_names_the_default_pair_once_and_as_the_catalog_does(catalog):
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    named = re.findall(r"default\s+pair\s+is\s+target\s+`([^`]+)`\s+with\s+drafter\s+`([^`]+)`", readme)
    assert named == [(catalog.default.target, catalog.default.drafter)]
