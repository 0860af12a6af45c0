"""perseus-convert properties: random whitespace and comments survive conversion; conversion is idempotent
(on random variants of a script and on the whole corpus)."""

import os

import pytest

pytest.importorskip("libcst")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from perseus.convert import convert_source  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "convert_corpus")

# A script as lines; {c} marks where a comment may go, {s} where extra spaces may go.
TEMPLATE = [
    "import torch{c}",
    "from torch.utils.data import DataLoader{c}",
    "{c}",
    "model = torch.nn.Linear(2,{s}1){c}",
    "opt = torch.optim.SGD(model.parameters(),{s}lr=0.1){c}",
    "loader = DataLoader(data,{s}batch_size=4){c}",
    "for epoch in range(2):{c}",
    "    for x, y in loader:{c}",
    "        opt.zero_grad(){c}",
    "        loss = ((model(x){s}- y) ** 2).mean(){c}",
    "        loss.backward(){c}",
    "        opt.step(){c}",
    "    print(epoch,{s}loss.item()){c}",
]

comments = st.one_of(st.just(""), st.text(alphabet="abc xyz#:()", max_size=12).map(lambda t: "  # " + t))
spaces = st.sampled_from(["", " ", "   ", "\t"])


@st.composite
def scripts(draw):
    lines = []
    for template in TEMPLATE:
        line = template.replace("{s}", draw(spaces)).replace("{c}", draw(comments))
        if template == "{c}":
            line = line.strip()
        lines.append(line)
    return "\n".join(lines) + "\n"


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts())
def test_comments_and_spacing_round_trip(source):
    result = convert_source(source, "t.py")
    assert result.error is None, result.error
    out = result.converted
    for line in source.splitlines():  # every line no rule rewrites is still there, byte for byte
        if line.strip() and "DataLoader(data" not in line:
            assert line.strip() in out, line
    for comment in [line[line.index("#"):] for line in source.splitlines() if "#" in line]:
        assert comment in out
    assert convert_source(out, "t.py").converted == out


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(CORPUS) if f.endswith(".py")))
def test_corpus_conversion_is_idempotent(name):
    with open(os.path.join(CORPUS, name)) as f:
        source = f.read()
    once = convert_source(source, name)
    assert once.error is None
    twice = convert_source(once.converted, name)
    assert twice.converted == once.converted and not twice.changes
    for line in source.splitlines():  # lines are only ever added around, never lost
        if line.strip().startswith("#"):
            assert line.strip() in once.converted
