"""perseus-convert: every rewrite rule on a small input, compared as exact text."""

import subprocess
import sys

import pytest

pytest.importorskip("libcst")

from perseus.convert import Options, convert_source  # noqa: E402

pytestmark = pytest.mark.timeout(60)

CASES = {
    'horovod_imports': (
        'import horovod.torch as hvd\nimport horovod\nfrom horovod.tensorflow import keras as hk  # keep\n\nhvd.init()\nn = horovod.torch.size()\n',
        Options(),
        'import perseus.torch as hvd\nimport perseus\nfrom perseus.tensorflow import keras as hk  # keep\n\nhvd.init()\nn = perseus.torch.size()\n',
    ),
    'torch_optimizer_assign': (
        'import torch\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)  # note\n',
        Options(),
        'import torch\nimport perseus.torch as hvd\n\nhvd.init()\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)  # note\nopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())\nhvd.broadcast_parameters(model.state_dict(), root_rank=0)\n',
    ),
    'torch_optimizer_return': (
        'import torch\n\n\ndef make(model):\n    return torch.optim.Adam(model.parameters())\n',
        Options(),
        'import torch\nimport perseus.torch as hvd\n\nhvd.init()\n\n\ndef make(model):\n    optimizer = torch.optim.Adam(model.parameters())\n    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())\n    hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n    return optimizer\n',
    ),
    'torch_scale_lr': (
        'import torch\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=base_lr + 1)\n',
        Options(scale_lr=True),
        'import torch\nimport perseus.torch as hvd\n\nhvd.init()\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=(base_lr + 1) * hvd.size())\nopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())\nhvd.broadcast_parameters(model.state_dict(), root_rank=0)\n',
    ),
    'torch_loader_epoch': (
        'import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds, batch_size=4, shuffle=True)\nfor epoch in range(3):\n    # one pass\n    for x in loader:\n        pass\n',
        Options(),
        'import torch\nfrom torch.utils.data import DataLoader\nimport perseus.torch as hvd\nfrom torch.utils.data.distributed import DistributedSampler\n\nhvd.init()\n\nloader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True))\nfor epoch in range(3):\n    # one pass\n    loader.sampler.set_epoch(epoch)\n    for x in loader:\n        pass\n',
    ),
    'torch_guards': (
        "import torch\n\nprint('start')\ntorch.save(m, 'm.pt')\nif rank == 0:\n    print('already guarded')\n",
        Options(),
        "import torch\nimport perseus.torch as hvd\n\nhvd.init()\n\nif hvd.rank() == 0:\n    print('start')\nif hvd.rank() == 0:\n    torch.save(m, 'm.pt')\nif rank == 0:\n    print('already guarded')\n",
    ),
    'torch_cuda': (
        'import torch\n\nx = torch.zeros(1).cuda()\n',
        Options(),
        'import torch\nimport perseus.torch as hvd\n\nhvd.init()\nif torch.cuda.is_available():\n    torch.cuda.set_device(hvd.local_rank())\n\nx = torch.zeros(1).cuda()\n',
    ),
    'torch_average_metrics': (
        "import torch\n\nloss = torch.tensor(1.0)\nprint(f'loss {loss.item():.3f}')\n",
        Options(average_metrics=True),
        'import torch\nimport perseus.torch as hvd\n\nhvd.init()\n\nloss = torch.tensor(1.0)\nloss_item_avg = hvd.allreduce(torch.tensor(float(loss.item())), name="metric.4.0").item()\nif hvd.rank() == 0:\n    print(f\'loss {loss_item_avg:.3f}\')\n',
    ),
    'keras_compile_fit': (
        "import tensorflow as tf\n\nmodel.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss='mse')\nmodel.fit(x, y, epochs=1)\n",
        Options(),
        'import tensorflow as tf\nimport perseus.tensorflow.keras as hvd\n\nhvd.init()\ngpus = tf.config.list_physical_devices("GPU")\nif gpus:\n    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")\n\nmodel.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)), loss=\'mse\')\nmodel.fit(x[hvd.rank():len(x) - len(x) % hvd.size():hvd.size()], y[hvd.rank():len(y) - len(y) % hvd.size():hvd.size()], epochs=1, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()], verbose="auto" if hvd.rank() == 0 else 0)\n',
    ),
    'tf_tape': (
        'import tensorflow as tf\n\nmodel = tf.keras.Sequential([])\nwith tf.GradientTape() as tape:\n    loss = model(x)\ngrads = tape.gradient(loss, model.trainable_variables)\nopt.apply_gradients(zip(grads, model.trainable_variables))\n',
        Options(),
        'import tensorflow as tf\nimport perseus.tensorflow as hvd\n\nhvd.init()\ngpus = tf.config.list_physical_devices("GPU")\nif gpus:\n    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")\n\nmodel = tf.keras.Sequential([])\nhvd.broadcast_variables([v if isinstance(v, tf.Variable) else v.value for v in model.variables], root_rank=0)\nwith tf.GradientTape() as tape:\n    loss = model(x)\ntape = hvd.DistributedGradientTape(tape)\ngrads = tape.gradient(loss, model.trainable_variables)\nopt.apply_gradients(zip(grads, model.trainable_variables))\n',
    ),
    'torch_root_file_reads': (
        'import os\nimport torch\n\nmodel = torch.nn.Linear(2, 1)\nif os.path.exists(ckpt):\n    model.load_state_dict(torch.load(ckpt, map_location="cpu"))\nfor epoch in range(2):\n    torch.save(model.state_dict(), ckpt)\nbest = torch.load(ckpt) if os.path.isfile(ckpt) else None\n',
        Options(),
        'import os\nimport torch\nimport perseus.torch as hvd\nfrom perseus.common.files import root_call, root_file\n\nhvd.init()\n\nmodel = torch.nn.Linear(2, 1)\nif root_call(os.path.exists, ckpt):\n    model.load_state_dict(torch.load(root_file(ckpt), map_location="cpu"))\nfor epoch in range(2):\n    if hvd.rank() == 0:\n        torch.save(model.state_dict(), ckpt)\nbest = torch.load(root_file(ckpt)) if root_call(os.path.isfile, ckpt) else None\n',
    ),
    'keras_root_file_reads': (
        'import tensorflow as tf\n\nmodel.compile(optimizer="adam", loss="mse")\nmodel.fit(x, y, callbacks=[tf.keras.callbacks.ModelCheckpoint(path, save_best_only=True)])\nbest = tf.keras.models.load_model(path)\nmodel.save_weights(weights)\nmodel.load_weights(weights)\n',
        Options(),
        'import tensorflow as tf\nimport perseus.tensorflow.keras as hvd\nfrom perseus.common.files import root_file\n\nhvd.init()\ngpus = tf.config.list_physical_devices("GPU")\nif gpus:\n    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")\n\nmodel.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.get("adam")), loss="mse")\nmodel.fit(x[hvd.rank():len(x) - len(x) % hvd.size():hvd.size()], y[hvd.rank():len(y) - len(y) % hvd.size():hvd.size()], callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), *([tf.keras.callbacks.ModelCheckpoint(path, save_best_only=True)] if hvd.rank() == 0 else [])], verbose="auto" if hvd.rank() == 0 else 0)\nbest = tf.keras.models.load_model(root_file(path))\nif hvd.rank() == 0:\n    model.save_weights(weights)\nmodel.load_weights(root_file(weights))\n',
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_output(name):
    source, options, expected = CASES[name]
    result = convert_source(source, "t.py", options)
    assert result.error is None
    assert result.converted == expected
    assert result.changes, "every change is reported"
    again = convert_source(result.converted, "t.py", options)
    assert again.converted == result.converted and not again.changes, "idempotent"


def test_untouched_text_is_kept_byte_for_byte():
    source = "import torch  # the framework\n\n\n# a comment\nx   =  [1,\n  2]   # odd spacing\n"
    result = convert_source(source, "t.py")
    assert result.converted.endswith("# a comment\nx   =  [1,\n  2]   # odd spacing\n")


def test_unparsable_file_is_reported_and_left_alone():
    result = convert_source("import torch\ndef f(:\n", "bad.py")
    assert result.error and "cannot parse" in result.error
    assert result.converted == result.source


def test_unconvertible_optimizer_is_a_warning():
    source = "import torch\n\nopts = [torch.optim.SGD(m.parameters(), lr=0.1)]\n"
    result = convert_source(source, "t.py")
    assert "opts = [torch.optim.SGD(m.parameters(), lr=0.1)]\n" in result.converted
    assert [w.line for w in result.warnings] == [3]
    assert "DistributedOptimizer" in result.warnings[0].manual_step


def test_custom_sampler_is_a_warning():
    source = "import torch\n\nloader = torch.utils.data.DataLoader(ds, sampler=my_sampler)\n"
    result = convert_source(source, "t.py")
    assert "sampler=my_sampler)" in result.converted and result.warnings


def test_evaluation_loader_is_not_sharded():
    source = "import torch\n\ntest_loader = torch.utils.data.DataLoader(test_set, batch_size=8)\n"
    assert "DistributedSampler" not in convert_source(source, "t.py").converted


def test_already_perseus_script_is_unchanged():
    source = "import perseus.torch as hvd\nimport torch\n\nhvd.init()\nprint(1)\n"
    result = convert_source(source, "t.py")
    assert result.converted == source and not result.changes


def test_unsupported_horovod_module_is_a_warning():
    result = convert_source("import horovod.data\n", "t.py")
    assert result.converted == "import perseus.data\n" and result.warnings
    result = convert_source("import horovod.spark\nimport horovod.ray\n", "t.py")
    assert result.converted == "import perseus.spark\nimport perseus.ray\n" and not result.warnings


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "perseus.convert.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_cli_modes(tmp_path):
    source = CASES["torch_optimizer_assign"][0]
    (tmp_path / "pkg").mkdir()
    script = tmp_path / "pkg" / "train.py"
    script.write_text(source)
    check = _cli("--check", "pkg", cwd=tmp_path)
    assert check.returncode == 1 and "would change" in check.stderr
    diff = _cli("--diff", "pkg/train.py", cwd=tmp_path)
    assert diff.returncode == 0 and "+opt = hvd.DistributedOptimizer(" in diff.stdout
    assert script.read_text() == source
    written = _cli("pkg", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "pkg" / "train_perseus.py").read_text() == CASES["torch_optimizer_assign"][2]
    assert "train.py:4: [torch]" in written.stderr
    again = _cli("pkg", cwd=tmp_path)  # the walk skips *_perseus.py outputs
    assert again.returncode == 0 and not (tmp_path / "pkg" / "train_perseus_perseus.py").exists()
    inplace = _cli("--in-place", "pkg/train.py", cwd=tmp_path)
    assert inplace.returncode == 0
    assert script.read_text() == CASES["torch_optimizer_assign"][2]
    assert (tmp_path / "pkg" / "train.py.bak").read_text() == source
    assert _cli("--check", "pkg/train.py", cwd=tmp_path).returncode == 0


def test_cli_errors(tmp_path):
    (tmp_path / "bad.py").write_text("def f(:\n")
    bad = _cli("bad.py", cwd=tmp_path)
    assert bad.returncode == 2 and "cannot parse" in bad.stderr
    assert not (tmp_path / "bad_perseus.py").exists()
    assert _cli("missing.py", cwd=tmp_path).returncode == 2
    (tmp_path / "w.py").write_text("import torch\n\nopts = [torch.optim.SGD(m.parameters())]\n")
    warn = _cli("w.py", cwd=tmp_path)
    assert warn.returncode == 1 and "manual step" in warn.stderr


# -- files written on rank 0 only and read back on every rank -------------------------------------------

def test_root_file_reads_are_reported():
    result = convert_source(CASES["torch_root_file_reads"][0], "t.py")
    lines = result.lines()
    assert "t.py:5: [torch] os.path.exists(ckpt) -> root_call(...): asked on rank 0 only, so that every rank " \
           "takes the same branch around the read of line 6" in lines
    assert sum("torch.load(...) reads its file through root_file(...)" in line for line in lines) == 2
    assert not result.warnings


def test_reads_without_rank0_writes_are_left_alone():
    source = "import torch\n\nmodel = torch.nn.Linear(2, 1)\nmodel.load_state_dict(torch.load(args.pretrained))\n"
    result = convert_source(source, "t.py")
    assert "root_file" not in result.converted and "torch.load(args.pretrained)" in result.converted


def test_reads_that_must_stay_local_are_not_rewritten():
    source = ("import torch\n\ntorch.save(m.state_dict(), 'm.pt')\n"
              "if rank == 0:\n    check = torch.load('m.pt')\n"         # under a test of the rank
              "print(torch.load('m.pt'))\n"                                # in a print put on rank 0
              "transform = lambda p: torch.load(p)\n"                      # per sample
              "\n\nclass Shards(torch.utils.data.Dataset):\n"
              "    def __getitem__(self, i):\n        return read_shard(self.files[i])\n"
              "\n\ndef read_shard(path):\n    return torch.load(path)\n"   # called per sample by a data set
              "\n\nstate = torch.load('m.pt')\n")
    result = convert_source(source, "t.py")
    out = result.converted
    assert out.count("root_file(") == 1 and "state = torch.load(root_file('m.pt'))" in out
    for kept in ("    check = torch.load('m.pt')", "print(torch.load('m.pt'))", "lambda p: torch.load(p)",
                 "return torch.load(path)"):
        assert kept in out


def test_open_is_rewritten_only_for_files_the_script_writes():
    source = ("import os\nimport torch\n\nwith open(os.path.join(out_dir, 'log.txt'), 'a') as log:\n"
              "    log.write('x')\n"
              "with open(os.path.join(out_dir, 'log.txt')) as f:\n    text = f.read()\n"
              "with open(args.labels, 'r') as f:\n    labels = f.read()\n"
              "with open(best_path, 'rb') as fh:\n    state = torch.load(fh)\n"
              "torch.save(state, best_path)\n"
              "\n\ndef read_text(best_path):\n    return open(best_path).read()\n")  # its own best_path
    out = convert_source(source, "t.py").converted
    assert "    return open(best_path).read()\n" in out
    assert "with open(root_file(os.path.join(out_dir, 'log.txt'))) as f:" in out
    assert "with open(args.labels, 'r') as f:" in out
    assert "with open(root_file(best_path), 'rb') as fh:\n    state = torch.load(fh)\n" in out


def test_open_of_a_written_file_in_an_unknown_mode_is_a_warning():
    source = "import torch\n\ntorch.save(m, path)\nf = open(path, mode)\n"
    result = convert_source(source, "t.py")
    assert "f = open(path, mode)\n" in result.converted
    assert [w.line for w in result.warnings] == [4] and "root_file" in result.warnings[0].manual_step


def test_file_system_questions_that_decide_a_read_are_asked_on_rank_0():
    source = ("import glob\nimport os\nfrom pathlib import Path\nimport torch\n\ntorch.save(m, 'ckpt/last.pt')\n"
              "found = sorted(glob.glob('ckpt/*.pt'))\nif found:\n    state = torch.load(found[-1])\n"
              "if Path('ckpt/last.pt').exists():\n    state = torch.load('ckpt/last.pt')\n"
              "states = [torch.load(p) for p in os.listdir('ckpt')]\n"
              "if not os.path.isdir('ckpt'):\n    os.makedirs('ckpt')\n")
    out = convert_source(source, "t.py").converted
    assert "found = sorted(root_call(glob.glob, 'ckpt/*.pt'))\n" in out
    assert "if root_call(Path('ckpt/last.pt').exists):\n" in out
    assert "states = [torch.load(root_file(p)) for p in root_call(os.listdir, 'ckpt')]\n" in out
    assert "if not os.path.isdir('ckpt'):\n" in out  # decides no read: every rank makes its own folder


def test_helper_names_do_not_collide():
    source = "import torch\n\nroot_file = 'x'\ntorch.save(m, p)\nm = torch.load(p)\n"
    out = convert_source(source, "t.py").converted
    assert "from perseus.common.files import root_file as perseus_root_file\n" in out
    assert "m = torch.load(perseus_root_file(p))\n" in out


def test_lbfgs_state_is_not_broadcast():
    source = ("import torch\n\nmodel = torch.nn.Linear(2, 1)\n"
              "opt = torch.optim.LBFGS(model.parameters(), lr=1)\nopt.load_state_dict(torch.load(p))\n"
              "torch.save(opt.state_dict(), p)\n")
    result = convert_source(source, "t.py")
    assert "broadcast_optimizer_state" not in result.converted
    assert "opt.load_state_dict(torch.load(root_file(p)))\n" in result.converted and not result.warnings
    other = convert_source(source.replace("torch.load(p)", "saved"), "t.py")
    assert "broadcast_optimizer_state" not in other.converted
    assert [w.line for w in other.warnings] == [5] and "same state" in other.warnings[0].manual_step


def test_lbfgs_closure_script_is_converted_without_warnings():
    source = ("import torch\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.LBFGS(model.parameters())\n"
              "def closure():\n    opt.zero_grad()\n    loss = model(x).sum()\n    loss.backward()\n"
              "    return loss\nopt.step(closure)\n")
    result = convert_source(source, "t.py")
    assert "opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())\n" in result.converted
    assert "opt.step(closure)\n" in result.converted and not result.warnings
