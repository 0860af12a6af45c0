"""perseus-convert, MXNet Gluon rules: every rewrite on a small input, compared as exact text (the converted
script and the report). Needs libcst only, not MXNet."""

import subprocess
import sys

import pytest

pytest.importorskip("libcst")

from perseus.convert import Options, convert_source  # noqa: E402

pytestmark = pytest.mark.timeout(60)

# name -> (source, options, converted source, report lines)
CASES = {
    'mxnet_basic': (
        'import mxnet as mx\nfrom mxnet import autograd, gluon\n\nnet = gluon.nn.Dense(1)\nnet.initialize(mx.init.Xavier())  # deferred shapes\nloader = gluon.data.DataLoader(train_set, batch_size=8, shuffle=True)\ntrainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="device")\nfor x, y in loader:\n    trainer.step(x.shape[0])\nprint("done")\nnet.save_parameters("net.params")\nnet.export("net")\n',
        Options(),
        'import mxnet as mx\nfrom mxnet import autograd, gluon\nimport perseus.mxnet as hvd\n\nhvd.init()\n\nnet = gluon.nn.Dense(1)\nnet.initialize(mx.init.Xavier())  # deferred shapes\nhvd.broadcast_parameters(net.collect_params(), root_rank=0)\nloader = gluon.data.DataLoader(gluon.data.SimpleDataset(range(hvd.rank(), len(train_set) - len(train_set) % hvd.size(), hvd.size())).transform(train_set.__getitem__), batch_size=8, shuffle=True)\ntrainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})\nfor x, y in loader:\n    trainer.step(x.shape[0])\nif hvd.rank() == 0:\n    print("done")\nif hvd.rank() == 0:\n    net.save_parameters("net.params")\nif hvd.rank() == 0:\n    net.export("net")\n',
        ['t.py:2: [mxnet] import perseus.mxnet as hvd and call hvd.init() once, at start-up', "t.py:5: [mxnet] rank 0's parameters (net.collect_params()) broadcast to every rank once initialised (a parameter with deferred shape is broadcast when the first forward pass creates it)", "t.py:6: [mxnet] DataLoader reads rank r's share of train_set: samples r, r+size(), ... (the same count on every rank; shuffle and last_batch apply within the share)", 't.py:7: [mxnet] gluon.Trainer -> hvd.DistributedTrainer: gradients are averaged over all ranks at every step()', 't.py:7: [mxnet] kvstore="device" dropped: DistributedTrainer has no kvstore, the ranks average the gradients themselves', 't.py:10: [mxnet] progress print only on rank 0 (`if hvd.rank() == 0:`): every rank runs the same code', 't.py:11: [mxnet] checkpoint/log write only on rank 0 (`if hvd.rank() == 0:`): every rank runs the same code', 't.py:12: [mxnet] checkpoint/log write only on rank 0 (`if hvd.rank() == 0:`): every rank runs the same code'],
    ),
    'mxnet_params_name': (
        'from mxnet import gluon\n\n\ndef build(net):\n    params = net.collect_params()\n    params.initialize()\n    return gluon.Trainer(params, "adam", None, "local", None, False)\n',
        Options(),
        'from mxnet import gluon\nimport perseus.mxnet as hvd\n\nhvd.init()\n\n\ndef build(net):\n    params = net.collect_params()\n    params.initialize()\n    hvd.broadcast_parameters(params, root_rank=0)\n    return hvd.DistributedTrainer(params, "adam", None)\n',
        ['t.py:1: [mxnet] import perseus.mxnet as hvd and call hvd.init() once, at start-up', "t.py:6: [mxnet] rank 0's parameters (params) broadcast to every rank once initialised (a parameter with deferred shape is broadcast when the first forward pass creates it)", 't.py:7: [mxnet] gluon.Trainer -> hvd.DistributedTrainer: gradients are averaged over all ranks at every step()', 't.py:7: [mxnet] kvstore="local" dropped: DistributedTrainer has no kvstore, the ranks average the gradients themselves', 't.py:7: [mxnet] compression_params=None dropped: DistributedTrainer has no kvstore, the ranks average the gradients themselves', 't.py:7: [mxnet] update_on_kvstore=False dropped: DistributedTrainer has no kvstore, the ranks average the gradients themselves'],
    ),
    'mxnet_two_trainers': (
        'import mxnet as mx\n\ng.initialize()\nd.collect_params().initialize()\ng_trainer = mx.gluon.Trainer(g.collect_params(), "adam")\nd_trainer = mx.gluon.Trainer(d.collect_params(), "adam",)\n',
        Options(),
        'import mxnet as mx\nimport perseus.mxnet as hvd\n\nhvd.init()\n\ng.initialize()\nhvd.broadcast_parameters(g.collect_params(), root_rank=0)\nd.collect_params().initialize()\nhvd.broadcast_parameters(d.collect_params(), root_rank=0)\ng_trainer = hvd.DistributedTrainer(g.collect_params(), "adam", prefix="g_trainer.")\nd_trainer = hvd.DistributedTrainer(d.collect_params(), "adam", prefix="d_trainer.",)\n',
        ['t.py:1: [mxnet] import perseus.mxnet as hvd and call hvd.init() once, at start-up', "t.py:3: [mxnet] rank 0's parameters (g.collect_params()) broadcast to every rank once initialised (a parameter with deferred shape is broadcast when the first forward pass creates it)", "t.py:4: [mxnet] rank 0's parameters (d.collect_params()) broadcast to every rank once initialised (a parameter with deferred shape is broadcast when the first forward pass creates it)", "t.py:5: [mxnet] mx.gluon.Trainer -> hvd.DistributedTrainer: gradients are averaged over all ranks at every step() (gradient names prefixed 'g_trainer.')", "t.py:6: [mxnet] mx.gluon.Trainer -> hvd.DistributedTrainer: gradients are averaged over all ranks at every step() (gradient names prefixed 'd_trainer.')"],
    ),
    'mxnet_gpu': (
        'import mxnet as mx\n\nctx = mx.gpu(0)\ndefault = mx.gpu()\n',
        Options(),
        'import mxnet as mx\nimport perseus.mxnet as hvd\n\nhvd.init()\n\nctx = mx.gpu(hvd.local_rank())\ndefault = mx.gpu(hvd.local_rank())\n',
        ['t.py:1: [mxnet] import perseus.mxnet as hvd and call hvd.init() once, at start-up', 't.py:3: [mxnet] mx.gpu(0) -> mx.gpu(hvd.local_rank()): each process uses the GPU of its local rank', 't.py:4: [mxnet] mx.gpu() -> mx.gpu(hvd.local_rank()): each process uses the GPU of its local rank', 't.py:3: warning: [mxnet] perseus.mxnet moves CPU NDArrays only (a GPU NDArray raises NotImplementedError) -- manual step: train on mx.cpu() contexts'],
    ),
    'mxnet_scale_lr': (
        'import mxnet as mx\nfrom mxnet import gluon\n\nnet.initialize()\ntrainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": base + 1, "wd": 1e-4})\nt2 = gluon.Trainer(net.collect_params(), mx.optimizer.SGD(learning_rate=0.1))\n',
        Options(scale_lr=True),
        'import mxnet as mx\nfrom mxnet import gluon\nimport perseus.mxnet as hvd\n\nhvd.init()\n\nnet.initialize()\nhvd.broadcast_parameters(net.collect_params(), root_rank=0)\ntrainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": (base + 1) * hvd.size(), "wd": 1e-4}, prefix="trainer.")\nt2 = hvd.DistributedTrainer(net.collect_params(), mx.optimizer.SGD(learning_rate=0.1 * hvd.size()), prefix="t2.")\n',
        ['t.py:2: [mxnet] import perseus.mxnet as hvd and call hvd.init() once, at start-up', "t.py:4: [mxnet] rank 0's parameters (net.collect_params()) broadcast to every rank once initialised (a parameter with deferred shape is broadcast when the first forward pass creates it)", 't.py:5: [mxnet] learning rate scaled by hvd.size() (--scale-lr): the global batch is size() times larger', "t.py:5: [mxnet] gluon.Trainer -> hvd.DistributedTrainer: gradients are averaged over all ranks at every step() (gradient names prefixed 'trainer.')", 't.py:6: [mxnet] learning rate scaled by hvd.size() (--scale-lr): the global batch is size() times larger', "t.py:6: [mxnet] gluon.Trainer -> hvd.DistributedTrainer: gradients are averaged over all ranks at every step() (gradient names prefixed 't2.')"],
    ),
    'mxnet_average_metrics': (
        'import mxnet as mx\n\nloss = mx.nd.ones((2,))\nprint(f"loss {loss.mean().asscalar():.3f}")\n',
        Options(average_metrics=True),
        'import mxnet as mx\nimport perseus.mxnet as hvd\n\nhvd.init()\n\nloss = mx.nd.ones((2,))\nloss_mean_asscalar_avg = hvd.allreduce(mx.nd.array([float(loss.mean().asscalar())], dtype="float64"), name="metric.4.0").asscalar()\nif hvd.rank() == 0:\n    print(f"loss {loss_mean_asscalar_avg:.3f}")\n',
        ['t.py:1: [mxnet] import perseus.mxnet as hvd and call hvd.init() once, at start-up', 't.py:4: [mxnet] progress print only on rank 0 (`if hvd.rank() == 0:`): every rank runs the same code', 't.py:4: [mxnet] 1 printed metric(s) averaged over all ranks before printing'],
    ),
    'mxnet_root_file_reads': (
        'import mxnet as mx\nfrom mxnet import gluon\n\nnet.initialize()\ntrainer = gluon.Trainer(net.collect_params(), "sgd")\nnet.save_parameters(best)\nnet.load_parameters(best)\n',
        Options(),
        'import mxnet as mx\nfrom mxnet import gluon\nimport perseus.mxnet as hvd\nfrom perseus.common.files import root_file\n\nhvd.init()\n\nnet.initialize()\nhvd.broadcast_parameters(net.collect_params(), root_rank=0)\ntrainer = hvd.DistributedTrainer(net.collect_params(), "sgd")\nif hvd.rank() == 0:\n    net.save_parameters(best)\nnet.load_parameters(root_file(best))\nhvd.broadcast_parameters(net.collect_params(), root_rank=0)\n',
        ['t.py:2: [mxnet] import perseus.mxnet as hvd and call hvd.init() once, at start-up', "t.py:4: [mxnet] rank 0's parameters (net.collect_params()) broadcast to every rank once initialised (a parameter with deferred shape is broadcast when the first forward pass creates it)", 't.py:5: [mxnet] gluon.Trainer -> hvd.DistributedTrainer: gradients are averaged over all ranks at every step()', 't.py:6: [mxnet] checkpoint/log write only on rank 0 (`if hvd.rank() == 0:`): every rank runs the same code', "t.py:7: [mxnet] rank 0's parameters (net.collect_params()) broadcast to every rank once initialised (a parameter with deferred shape is broadcast when the first forward pass creates it)", 't.py:7: [mxnet] net.load_parameters(...) reads its file through root_file(...): rank 0 reads it and sends it to every rank, which loads its own copy (this script writes files on rank 0 only; the other ranks may not see them yet, or at all)'],
    ),
    'mxnet_loader_import': (
        'from mxnet.gluon.data import ArrayDataset, DataLoader\n\nloader = DataLoader(ArrayDataset(x, y), batch_size=4)\n',
        Options(),
        'from mxnet.gluon.data import ArrayDataset, DataLoader\nimport perseus.mxnet as hvd\nfrom mxnet.gluon.data import SimpleDataset\n\nhvd.init()\n\nloader_dataset = ArrayDataset(x, y)\nloader = DataLoader(SimpleDataset(range(hvd.rank(), len(loader_dataset) - len(loader_dataset) % hvd.size(), hvd.size())).transform(loader_dataset.__getitem__), batch_size=4)\n',
        ['t.py:1: [mxnet] import perseus.mxnet as hvd and call hvd.init() once, at start-up', "t.py:3: [mxnet] DataLoader reads rank r's share of loader_dataset: samples r, r+size(), ... (the same count on every rank; shuffle and last_batch apply within the share)"],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_output(name):
    source, options, expected, report = CASES[name]
    result = convert_source(source, "t.py", options)
    assert result.error is None
    assert result.framework == "mxnet"
    assert result.converted == expected
    assert result.lines() == report
    again = convert_source(result.converted, "t.py", options)
    assert again.converted == result.converted and not again.changes and not again.warnings, "idempotent"


def _warnings(source, options=None):
    result = convert_source(source, "t.py", options or Options())
    assert result.error is None
    return result, [line for line in result.lines() if "warning:" in line]


def test_uninitialised_parameters_are_a_warning():
    source = "from mxnet import gluon\n\nnet = make()\ntrainer = gluon.Trainer(net.collect_params(), 'sgd')\n"
    result, warnings = _warnings(source)
    assert "trainer = hvd.DistributedTrainer(net.collect_params(), 'sgd')\n" in result.converted
    assert "broadcast_parameters" not in result.converted
    assert warnings == ["t.py:4: warning: [mxnet] cannot find where the parameters of net are initialised -- manual "
                        "step: after net.initialize(...): hvd.broadcast_parameters(net.collect_params(), "
                        "root_rank=0)"]


def test_trainer_with_unknown_parameters_is_a_warning():
    source = "from mxnet import gluon\n\ntrainer = gluon.Trainer(*args)\n"
    result, warnings = _warnings(source)
    assert "trainer = gluon.Trainer(*args)\n" in result.converted
    assert len(warnings) == 1 and warnings[0].startswith("t.py:3: warning: [mxnet] cannot read the arguments")


def test_compression_params_are_a_warning():
    source = ("from mxnet import gluon\n\nnet.initialize()\n"
              "trainer = gluon.Trainer(net.collect_params(), 'sgd', compression_params={'type': '2bit'})\n")
    result, warnings = _warnings(source)
    assert "trainer = hvd.DistributedTrainer(net.collect_params(), 'sgd')\n" in result.converted
    assert warnings == ["t.py:4: warning: [mxnet] compression_params dropped: DistributedTrainer has no kvstore "
                        "compression -- manual step: pass compression=hvd.Compression.fp16 to send float16 "
                        "gradients, if wanted"]


def test_gpu_chosen_by_expression_is_a_warning():
    source = "import mxnet as mx\n\nctx = [mx.gpu(i) for i in range(4)]\n"
    result, warnings = _warnings(source)
    assert "ctx = [mx.gpu(i) for i in range(4)]\n" in result.converted
    assert warnings[0] == ("t.py:3: warning: [mxnet] device chosen by an expression: mx.gpu(i) -- manual step: "
                           "use one GPU per process: mx.gpu(hvd.local_rank())")


def test_io_iterator_and_custom_sampler_are_warnings():
    source = ("import mxnet as mx\nfrom mxnet import gluon\n\ntrain_iter = mx.io.NDArrayIter(x, y, 32)\n"
              "val_iter = mx.io.NDArrayIter(vx, vy, 32)\n"
              "loader = gluon.data.DataLoader(ds, batch_size=4, sampler=my_sampler)\n")
    result, warnings = _warnings(source)
    assert "sampler=my_sampler)\n" in result.converted and "SimpleDataset" not in result.converted
    assert [w.split(" -- ")[0] for w in warnings] == [
        "t.py:4: warning: [mxnet] mx.io.NDArrayIter gives every rank all of the data",
        "t.py:6: warning: [mxnet] this DataLoader has its own sampler"]


def test_evaluation_loader_is_not_sharded():
    source = "from mxnet import gluon\n\nval_loader = gluon.data.DataLoader(val_set, batch_size=8)\n"
    assert "SimpleDataset" not in convert_source(source, "t.py").converted


def test_already_perseus_script_is_unchanged():
    source = "import mxnet as mx\nimport perseus.mxnet as hvd\n\nhvd.init()\nprint(1)\n"
    result = convert_source(source, "t.py")
    assert result.converted == source and not result.changes and not result.warnings


def test_horovod_mxnet_script_is_renamed_only():
    source = ("import mxnet as mx\nimport horovod.mxnet as hvd\n\nhvd.init()\n"
              "trainer = hvd.DistributedTrainer(params, 'sgd')\n")
    result = convert_source(source, "t.py")
    assert result.converted == source.replace("horovod.mxnet", "perseus.mxnet")
    assert result.lines() == ["t.py:2: [horovod] import from perseus instead of horovod"]


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "perseus.convert.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_cli_exit_status(tmp_path):
    (tmp_path / "clean.py").write_text(CASES["mxnet_basic"][0])
    clean = _cli("clean.py", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    assert (tmp_path / "clean_perseus.py").read_text() == CASES["mxnet_basic"][2]
    assert "clean.py:7: [mxnet] gluon.Trainer -> hvd.DistributedTrainer" in clean.stderr
    (tmp_path / "gpu.py").write_text(CASES["mxnet_gpu"][0])
    gpu = _cli("gpu.py", cwd=tmp_path)
    assert gpu.returncode == 1 and "manual step: train on mx.cpu() contexts" in gpu.stderr
    assert _cli("--check", "clean_perseus.py", cwd=tmp_path).returncode == 0
