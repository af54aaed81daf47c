"""Checkpoints: everything needed to continue a run exactly, written atomically and durably, verified before
anything is read, read without unpickling.

Layout of ``RUN_DIR/checkpoints/step-NNNNNNNN/``::

    trainer.json                 position (epoch, batch, step), totals, the config
    rank{r}.rng.json / .safetensors   RNG states of each process (python, torch, and its GPU's in a CUDA run)
    stage{i}/model.safetensors   the stage's parameters and buffers
    stage{i}/optimizer.pt        optimizer state (torch.save; loaded with weights_only=True)
    stage{i}/scheduler.json      LR scheduler state
    stage{i}/schemes/<key>/      each boundary scheme's state on this stage's sides (AQ-SGD caches, EF
                                 buffers): what the scheme's save() writes, and shape.json (the shape and
                                 dtype it was built for); <key> is b<N>-forward|backward-sender|receiver
    rank{r}.manifest.json        the files rank r wrote: size and SHA-256 of each
    MANIFEST.json                the run's shape (stages, replicas, processes) and the size and SHA-256 of
                                 every rank{r}.manifest.json
    COMPLETE                     the step and the SHA-256 of MANIFEST.json; a folder without it is ignored

With data parallelism (``D > 1`` replicas of the pipeline, see :mod:`aqsgd.parallel.grid`) the replicas of a
stage hold bit-identical parameters and optimizer states (every replica applies the same averaged gradient),
so ``model.safetensors``, ``optimizer.pt`` and ``scheduler.json`` are written once per stage, by replica 0,
and every replica loads them. What differs between replicas is kept per replica (``rank{r}`` files are per
global rank as always)::

    stage{i}/replica{r}/schemes/<key>/        replica r's boundary schemes (its samples' AQ-SGD cache rows,
                                              its EF buffers)
    stage{i}/replica{r}/grad_sync.safetensors the gradient synchronization's error-feedback state (quantized
                                              sync, PowerSGD), one per rank

Replicas that take outer steps (``--grad-sync diloco:H``) differ inside a round: each writes its own
``model.safetensors``, ``optimizer.pt`` and ``scheduler.json`` under ``stage{i}/replica{r}/``, beside
``outer.safetensors`` (the round's anchors, the outer momentum, the steps taken, the averaging's error
feedback); ``stage{i}/model.safetensors`` then holds the weights the replicas last agreed on (the last outer
step's), what export and evaluation read. A run's last step ends a round: its final checkpoint's replicas
agree.

With ``D = 1`` the layout is the one above (no ``replica{r}`` level), as before data parallelism. An
elastic replica's run (``--dp-elastic``: a run directory and a grid of one replica each) takes outer steps,
so it writes its own state under ``stage{i}/replica0/`` and the agreed weights as
``stage{i}/model.safetensors``, as replica 0 of a fixed group does.

State
-----
A checkpoint holds no knowledge of the engine's insides: it asks
:meth:`~aqsgd.train.engine.PipelineEngine.state_dict` what to save and hands what it reads back to
:meth:`~aqsgd.train.engine.PipelineEngine.load_state_dict`. Per stage that state maps to the files above::

    model            {name: tensor}              stage{i}/model.safetensors
    optimizer        the optimizer's state_dict  stage{i}/optimizer.pt
    optimizer_class  its class name              the "optimizers" entry of the rank manifest
    scheduler        the scheduler's state_dict  stage{i}/scheduler.json
    schemes          {(b, channel, side): {"shape", "dtype", "scheme"}}
                                                 [replica{r}/]schemes/<key>/: scheme.save(folder), shape.json
    grad_sync        {name: tensor}              [replica{r}/]grad_sync.safetensors
    outer            {name: tensor}              replica{r}/outer.safetensors

A boundary scheme's state is written by the scheme itself into its folder (disk caches can be many GB);
:meth:`~aqsgd.pipeline.runner.StageRunner.load_state_dict` takes that folder in place of the scheme, builds
the scheme for the saved shape and dtype and loads it. Restoring goes one entry at a time, so that any
failure names its file.

Writing
-------
A checkpoint is written into ``step-N.tmp``. Every process writes its own files there, reads each back once to
hash it (SHA-256, streamed in 8 MiB chunks, several files at a time) and fsyncs it, then writes and fsyncs its
``rank{r}.manifest.json`` and fsyncs the folders it created. After all processes agree that they succeeded,
rank 0 writes ``MANIFEST.json`` and ``COMPLETE``, fsyncs them and the folder, renames ``step-N.tmp`` to
``step-N`` and fsyncs ``checkpoints/``: a crash at any moment leaves the earlier checkpoints and either no
``step-N`` or a complete one. (In a distributed run the run directory must be shared by the stage
processes, as it is on one machine or a shared filesystem.) Any failure (a full disk, say) on any process is
one :class:`CheckpointError` on every process naming the step, the file and the cause; the partial
``step-N.tmp`` is removed and the earlier checkpoints are kept. Left-over ``step-*.tmp`` folders of a crashed
run are never loaded and are removed by the next save.

Reading
-------
:func:`latest_checkpoint` checks the chain ``COMPLETE`` -> ``MANIFEST.json`` -> ``rank{r}.manifest.json`` and
``trainer.json``; :func:`load_checkpoint` then checks every file this process is about to read against its
manifest (present, same size, same SHA-256; no unlisted file in a scheme's folder) and, from the manifests,
that the two sides of every boundary whose state must be bit-identical (AQ-SGD caches, EF21 estimates; see
:meth:`~aqsgd.schemes.base.BoundaryScheme.mirrored_state`) saved identical bytes. Only then is anything
loaded. Every problem, damage or a checkpoint that does not fit this run, is a :class:`CheckpointError` with
a one-line message naming the file.

Modules: :mod:`~aqsgd.train.checkpoint.layout` (names, places, the error),
:mod:`~aqsgd.train.checkpoint.manifest` (checksums, manifests, verification),
:mod:`~aqsgd.train.checkpoint.write` (durable writing, :func:`save_checkpoint`) and
:mod:`~aqsgd.train.checkpoint.read` (:func:`latest_checkpoint`, :func:`load_checkpoint`).
"""

from aqsgd.train.checkpoint.layout import CheckpointError
from aqsgd.train.checkpoint.manifest import file_digest
from aqsgd.train.checkpoint.read import latest_checkpoint, load_checkpoint, read_trainer_state
from aqsgd.train.checkpoint.write import save_checkpoint

__all__ = ["CheckpointError", "file_digest", "latest_checkpoint", "load_checkpoint", "read_trainer_state",
           "save_checkpoint"]
