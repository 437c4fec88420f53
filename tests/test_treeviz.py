"""Round pictures (numbaengine/treeviz.py): the layout, and the SVG text and marks of a drawn tree."""
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from numbaengine.ddtree import draft_tree
from numbaengine.treeviz import draw_tree, layout

VOCAB = ["a", "\n  b", "$x$", "c", "d", "e"]      # a newline, and a pair of `$` that would start mathtext


def svg_of(path):
    """(text of every <text>, id of every element) of an SVG file; parsing it checks that it is XML."""
    root = ET.parse(path).getroot()
    return {e.text for e in root.iter() if e.tag.endswith("text")}, {e.get("id") for e in root.iter()}


def test_layout_puts_a_parent_between_its_children():
    y = layout(np.array([-1, 0, 0, 1, 1, 2]))
    assert y.tolist() == [1.25, 0.5, 2.0, 0.0, 1.0, 2.0]


def test_draw_tree_writes_labels_and_marks(tmp_path):
    logits = np.random.default_rng(0).standard_normal((3, len(VOCAB))).astype(np.float32)
    tree = draft_tree("ddtree", 2, logits, 7)
    path = [0, 1] + [c for c in range(len(tree)) if tree.parents[c] == 1][:1]
    draw_tree(tree, np.array(path), 1, VOCAB.__getitem__, tmp_path / "t.svg", "round 1")
    texts, ids = svg_of(tmp_path / "t.svg")
    assert {repr(VOCAB[t]) for t in tree.tokens} <= texts                  # every node, `$` shown as typed
    assert repr(VOCAB[1]) in texts and "bonus" in texts                    # the bonus token, id 1
    assert {f"node{n}-accepted" for n in path} <= ids and "bonus" in ids
    assert {f"node{n}" for n in range(len(tree)) if n not in path} <= ids
    assert any(t.startswith("q=") for t in texts) and "root" in texts


@pytest.mark.parametrize("suffix,magic", [(".svg", b"<?xml"), (".png", b"\x89PNG")])
def test_draw_a_root_alone(tmp_path, suffix, magic):
    tree = draft_tree("ar", 3, None, 0)                                    # ar: no drafted nodes
    draw_tree(tree, np.array([0]), 4, VOCAB.__getitem__, tmp_path / f"t{suffix}")
    assert (tmp_path / f"t{suffix}").read_bytes().startswith(magic)
