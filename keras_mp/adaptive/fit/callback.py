"""``AdaptivePrecision``: applies the adaptive policy's decisions during ``fit``.

``fit`` adds one to a model under an adaptive policy (:mod:`~keras_mp.adaptive.fit.autofit`).
What the callback does, and when:

* ``set_model`` (when ``fit`` starts; the execution mode is chosen in ``set_params``, once the
  fit's length is known): finds the model's :class:`keras_mp.AdaptivePolicy` and its controlled
  layers (:func:`keras_mp.policies.adaptive_layers`), puts those an earlier fit too small to
  gain kept in float32 back in their narrowest dtype (``switching.release``), stores frozen
  weights in it (:mod:`~keras_mp.adaptive.storage.frozen`). With float32 the only candidate it
  does nothing else. Otherwise it installs the model's
  :class:`~keras_mp.adaptive.evidence.hooks.Hooks`, attaches a
  :class:`~keras_mp.adaptive.evidence.stats.LayerStatistics` and wraps the optimizer in a
  :class:`keras_mp.LossScaleOptimizer` that feeds them (``optimizer_setup.connect``): a dynamic
  scale where float16 is a candidate or ``loss_scale`` is given, else ``FixedLossScale(1.0)``,
  only to skip non-finite steps (:mod:`~keras_mp.adaptive.integration.skipping`).
* per train-function call, it picks a step: plain, statistics (one in ``statistics_every``) or
  probe (statistics plus the float32 probe, one in ``probe_every``, less often while probes
  confirm: :mod:`~keras_mp.adaptive.decisions.probe_schedule`). Plain and statistics steps share
  one trace (:mod:`~keras_mp.adaptive.evidence.hooks`); the probe is traced on its own (eager in
  a fit of few probe calls) on the batch the statistics step then trains on
  (:mod:`~keras_mp.adaptive.integration.step_functions`);
* after ``first_decision`` calls (early judgement), then every ``interval`` calls: reads the
  statistics once, asks :func:`~keras_mp.adaptive.decisions.controller.decide`, assigns the new
  dtypes in the policy and rebuilds the train functions only if a dtype (or a trial) changed.
  No variable is stored anew inside a fit.
* every epoch end: a callback passed to ``fit`` adds ``precision_switches`` and
  ``precision_narrow_layers`` to the logs (``History``; the one ``fit`` adds by itself leaves
  Keras's keys); with ``log_dir``, writes per-layer scalars for TensorBoard.

Persistence: the per-layer dtypes, controller records and step count live in the policy (written
once per model into a ``.keras`` file, read back whatever the loading process's global policy:
:mod:`~keras_mp.adaptive.policy.saved_policy`) and in variables of a small state object attached to
the model (which ``save_weights``, ``ModelCheckpoint``, ``BackupAndRestore`` and
``tf.train.Checkpoint(model=...)`` save and load). When ``fit`` starts, those variables win if they
differ from the policy: they were just restored, with the switch histories and timeline beside them
(a finished run's backup: when ``fit`` ends).

Example:
    >>> import keras, numpy as np, keras_mp
    >>> keras.utils.set_random_seed(0)  # the probe's verdict depends on the weights
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> cb = keras_mp.callbacks.AdaptivePrecision(interval=2)
    >>> h = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, epochs=2,
    ...               callbacks=[cb], verbose=0)
    >>> h.history["precision_switches"]
    [0, 0]
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_mp import _checks as checks
from keras_mp import execution
from keras_mp.adaptive.decisions import controller
from keras_mp.adaptive.decisions.probe_schedule import DEFAULT_BACKOFF, ProbeSchedule
from keras_mp.adaptive.evidence import float8, probe as probe_lib
from keras_mp.adaptive.evidence.hooks import Hooks
from keras_mp.adaptive.evidence.stats import LayerStatistics
from keras_mp.adaptive.integration import optimizer_setup, skipping, step_functions, switching
from keras_mp.adaptive.integration.loss_scales import LossScales
from keras_mp.adaptive.outputs import tensorboard
from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy
from keras_mp.adaptive.policy.controlled_layers import adaptive_layers, policy_of
from keras_mp.adaptive.record import timeline
from keras_mp.adaptive.record.state import PrecisionState, attached
from keras_mp.adaptive.storage import frozen
from keras_mp.scaling.optimizer import LossScaleOptimizer

__all__ = ["AdaptivePrecision"]

_STATS_ATTR = "_keras_mp_statistics"
_NONFINITE = ("output_nonfinite", "input_range", "nonfinite", "nonfinite_everywhere")  # see update
_STATE_ATTR = "_keras_mp_precision_state"
_HOOKS_ATTR = "_keras_mp_hooks"


class AdaptivePrecision(keras.callbacks.Callback):
    """Chooses each layer's compute dtype during ``fit`` from live evidence: gradient statistics,
    forward statistics of every layer, and a float32 probe for rounding loss (see the module
    docstring for what happens when).

    Args:
        interval: train-function calls between decisions, an int >= 1. Each decision reads a few
            small variables from the device once.
        statistics_every: statistics are gathered on one train-function call in this many (an int
            in ``[1, interval]``); the other calls run a trace without them. None:
            ``min(20, max(1, interval // 5))``, five samples per decision.
        probe_every: the float32 probe runs on one call in this many (an int >= 1; less often
            while probes confirm: ``probe_backoff``), or None for never (then demotions rest on
            range evidence alone). ``"auto"``: ``2 * interval``, the last call of every other
            decision interval. A probe costs about three extra forward and backward passes, two
            of them in float32. Models with a custom ``train_step`` get no probe.
        loss_scale: the schedule used when the callback wraps the optimizer (anything
            :class:`keras_mp.LossScaleOptimizer` accepts as ``schedule``); None: ``"dynamic"`` when
            float16 is a candidate and no wrapper otherwise. Ignored if the optimizer already is a
            :class:`keras_mp.LossScaleOptimizer`.
        first_decision: an int >= 1: a ``fit`` from scratch decides first after this many calls or
            the first epoch if shorter, when before ``interval`` and the fit's last call
            (``step_functions.first_call``); None: at ``interval``.
        log_dir: a directory for TensorBoard scalars (per layer: compute bits and key statistics;
            the loss scale; probe errors; switches), or None.
        verbose: 1 prints every switch.
        history_logs: True: ``precision_switches`` and ``precision_narrow_layers`` join the epoch's
            logs (``History``); False: they stay Keras's (the callback ``fit`` adds by itself).
        probe_backoff: while every probe confirms the dtypes, the gap between probes doubles up to
            ``probe_backoff * probe_every`` calls; any change brings it back
            (:mod:`~keras_mp.adaptive.decisions.probe_schedule`). 1: never.

    Attributes:
        events: every switch made so far, as dicts with ``step``, ``layer``, ``old``, ``new`` and
            ``reason``.
        scale_events: every loss-scale change the rule made (gradients that underflowed with
            headroom), as dicts with ``step``, ``layer`` (None for the global scale; with
            per-layer loss scales, the path of the layer whose own factor changed), ``old`` and
            ``new``.

    Use in a custom training loop: call :meth:`set_model` once (it wraps or observes
    ``model.optimizer``; use its ``scale_loss`` if it has one, and ``apply``), call the model with
    ``training=True``, then :meth:`step_end` after each step; when it returns switches, trace the
    train step again (e.g. build a new ``tf.function``). There statistics are gathered on every
    step; call :meth:`probe` with a batch now and then for the float32 probe.
    """

    def __init__(self, interval: int = 100, *, statistics_every: int | None = None,
                 probe_every: int | None | str = "auto", loss_scale: Any = None,
                 first_decision: int | None = 20, log_dir: str | None = None,
                 verbose: int = 0, history_logs: bool = True,
                 probe_backoff: int = DEFAULT_BACKOFF):
        super().__init__()
        interval = checks.count("interval", interval, 1)
        if statistics_every is None:
            # Five samples per decision, and never fewer than one step in 20
            # (the overhead budget: `python -m benchmarks.adaptive_overhead`).
            statistics_every = min(20, max(1, interval // 5))
        statistics_every = checks.count("statistics_every", statistics_every, 1, interval)
        probe_every = 2 * interval if probe_every == "auto" else probe_every
        if probe_every is not None:
            probe_every = checks.count("probe_every", probe_every, 1)
        if log_dir is not None and not isinstance(log_dir, str):
            raise TypeError(f"`log_dir` must be a path string or None, got {log_dir!r}.")
        if verbose not in (0, 1):
            raise ValueError(f"`verbose` must be 0 or 1, got {verbose!r}.")
        if not isinstance(history_logs, bool):
            raise TypeError(f"`history_logs` must be True or False, got {history_logs!r}.")
        optimizer_setup.check_loss_scale(loss_scale)
        self.interval = interval
        self.statistics_every = statistics_every
        self.probe_every = probe_every
        self.probe_backoff = checks.count("probe_backoff", probe_backoff, 1)
        self.loss_scale = loss_scale
        self.first_decision = None if first_decision is None else checks.count(
            "first_decision", first_decision, 1)
        self._first: int | None = None  # this fit's early decision (step_functions.first_call)
        self._first_start = 0  # ... and where its window began
        self._expected: int | None = None  # this fit's calls, where known (set_params)
        self.log_dir, self.verbose, self.history_logs = log_dir, verbose, history_logs
        self.events: list[dict[str, Any]] = []
        self.scale_events: list[dict[str, Any]] = []
        self._functions: step_functions.StepFunctions | None = None
        self._writer, self._inert, self._policy = None, False, None
        self._configured = self._retrace = False  # the execution choice taken (_configure)
        self._calls = self._epoch_switches = 0
        self._restored = False  # a checkpoint's state adopted (on_epoch_begin)
        self._probe_fn = self._probe_step = None  # the probe; its traced step, for fit, probe()

    # -- set-up ------------------------------------------------------------

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        policy = policy_of(model)
        if policy is None:
            raise ValueError(
                "AdaptivePrecision needs a model whose layers use a keras_mp.AdaptivePolicy: "
                "call keras_mp.set_global_policy('adaptive') (or 'adaptive_bfloat16', "
                "'adaptive_float16', or an AdaptivePolicy) before building the model.")
        if "float8" in policy.candidates and float8.prepare(model, policy):
            optimizer_setup.rebuild_for_new_variables(model)
        layers = adaptive_layers(model, policy)
        if not layers:
            raise ValueError("AdaptivePrecision found no layer under the model's "
                             "AdaptivePolicy (quantized layers and models do not count).")
        self._policy, self._layers, self._paths = policy, layers, tuple(x.path for x in layers)
        made = switching.release(policy, self._paths, layers, policy.calls)  # a fit's no_gain
        self.events += made
        if made or frozen.apply(model, layers):  # frozen weights in their layers' dtypes
            model.train_function = model.test_function = model.predict_function = None
        # Nothing to adapt: nothing runs (the step is plain Keras float32).
        self._inert = len(policy.candidates) == 1
        self._configured, self._retrace = False, False
        if self._inert:
            self._configure(in_fit_too=False)
            return
        hooks = getattr(model, _HOOKS_ATTR, None)
        if not isinstance(hooks, Hooks) or [id(x) for x in hooks.layers] != \
                [id(x) for x in layers]:
            hooks = Hooks(model, layers)
            object.__setattr__(model, _HOOKS_ATTR, hooks)
        self._hooks = hooks
        self._stats, _ = attached(model, _STATS_ATTR, LayerStatistics, self._paths,
                                  lambda: LayerStatistics(layers))
        object.__setattr__(self._stats, "hooks", hooks)
        self._state, created = attached(model, _STATE_ATTR, PrecisionState, self._paths,
                                        lambda: PrecisionState(self._paths))
        self._state.bind(model, policy)  # its record goes into weights files
        self._calls = policy.calls if created and policy.loaded else self._calls  # steps go on
        if created or not self._state.restored(policy.candidates):
            # (Otherwise a checkpoint was just loaded into them: on_epoch_begin adopts it.)
            self._state.write(self._states(), policy.candidates, self._calls)
        optimizer = self._connect_optimizer(model)
        self._scales = LossScales(optimizer, layers, hooks,
                                  per_layer=optimizer_setup.per_layer(self.model, policy, optimizer))
        self._scales.install(self._forward_order())
        self._probe_fn = self._make_probe() if step_functions.keras_train_step(model) else None
        self._probe_step = None
        # Custom loops (and later traces): statistics on every training call.
        hooks.forward = True
        # Recompiled, or wrapped just now: trace anew (_configure).
        self._retrace = optimizer is not getattr(self, "_optimizer", None)
        self._optimizer, self._restored = optimizer, False
        self._configure(in_fit_too=False)

    def _configure(self, in_fit_too: bool = True) -> None:
        """The execution choice (XLA or graph: the faster measured here): outside ``fit`` (a
        custom loop) in ``set_model``; in ``fit``, in ``set_params``, once the fit's length is
        known (a short fit measures nothing, :func:`keras_mp.execution.reasons.short_fit`)."""
        model = self.model
        if not in_fit_too and execution.start_up.in_fit(model):
            return
        execution.configure(model)
        if not self._inert and (self._retrace or model.train_function is None):
            # Recompiled, wrapped, or reset by the user: trace anew (else reuse the last fit's).
            self._functions = self._probe_step = None
        self._configured, self._retrace = True, False

    def set_params(self, params: dict) -> None:
        """Keras's ``fit`` parameters; the coming fit's length goes to the execution choice
        (``start_up.expect``: a short fit measures nothing), taken now, and early judgement."""
        super().set_params(params)
        if self.model is not None and isinstance(params, dict) and "epochs" in params:
            self._expected = execution.start_up.expected_calls(
                params, getattr(self.model, "steps_per_execution", 1))
            execution.start_up.expect(self.model, self._expected)
        if self._policy is not None and not self._configured:
            self._configure()

    def _connect_optimizer(self, model: keras.Model):
        """The optimizer the model adapts with (optimizer_setup.connect: a
        LossScaleOptimizer where loss scaling or the skip of non-finite steps
        needs one), connected to the statistics; returns it."""
        opt = optimizer_setup.connect(model, self._policy, self.loss_scale,
                                      step_functions.keras_train_step(model), skipping.enabled())
        sink = self._stats.accumulate
        if isinstance(opt, LossScaleOptimizer):
            self._stats.scale_floor = optimizer_setup.scale_floor(opt.schedule)
            opt.statistics_sink = sink
            opt.statistics_gate = self._hooks.statistics_on
        else:
            self._stats.scale_floor = None
            self._hooks.hook_optimizer(opt, sink)
        return opt

    def _make_probe(self):
        model, policy, layers, hooks = self.model, self._policy, self._layers, self._hooks

        def run(data):
            opt = model.optimizer
            scale = opt.loss_scale if isinstance(opt, LossScaleOptimizer) else 1.0
            with hooks.paused():  # the probe's passes record no forward statistics
                return probe_lib.probe(model, data, policy, layers, scale=scale,
                                       trial=self._trial_dtypes(),
                                       variable_factors=self._scales.variable_factors())
        return run

    def _probe_function(self):
        """The probe (fit's probe steps, :meth:`probe`): traced on its own anew whenever the train
        functions are (the dtypes and trials it runs are fixed then), or eager in a fit of few
        probe calls (:func:`~keras_mp.adaptive.integration.step_functions.eager_probes`)."""
        eager = step_functions.eager_probes(self.model, self._expected, self.probe_every,
                                            self._first)
        if self._probe_step is None or getattr(self._probe_step, "eager", False) != eager:
            run = self._probe_fn or self._make_probe()
            self._probe_step = step_functions.probe_function(
                self.model, run, self._stats.accumulate_probe, eager=eager)
        return self._probe_step

    def _trial_dtypes(self) -> dict[str, str]:
        return switching.trial_dtypes(self._policy, self._paths, self._states())

    # -- state -------------------------------------------------------------

    def _states(self) -> list[controller.LayerState]:
        return switching.layer_states(self._policy, self._paths)

    def _restore_from_variables(self) -> list[int] | None:
        """Adopts the state variables (and the record a weights file brought) if they differ
        from the policy's: a checkpoint (``BackupAndRestore``) was loaded. Returns the record's
        decision due soon (``[call, window start]``), if any."""
        states, calls = self._state.read(self._policy.candidates)
        self._calls = self._policy.calls = calls
        record = self._state.take_record() or {}
        if record.get("timeline") is not None:
            timeline.restore(self.model, record["timeline"])
        if switching.adopt(self._policy, self._paths, self._layers, states, record.get("history")):
            self._rebuild()
        held = self._state.probes and self._state.probes.get_config()  # this process's run
        self._state.set_probes(None if self.probe_every is None else ProbeSchedule.start(
            self.probe_every, self.probe_backoff, calls).restored(record.get("probes", held)))
        return record.get("schedule")

    def _rebuild(self) -> None:
        self._functions = self._probe_step = None  # rebuilt at the next step
        model = self.model
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)
        model.test_function = model.predict_function = None

    def _gateable(self) -> bool:
        """Whether plain and statistics steps can share one trace (statistics under a switch,
        :mod:`keras_mp.adaptive.integration.step_functions`): unless every step records statistics, or a
        float8-capable layer's call (it differs on statistics steps) is in the model."""
        return self.statistics_every > 1 and "float8" not in self._policy.candidates

    def _train_functions(self) -> tuple:
        """(plain, statistics, probe) (:mod:`keras_mp.adaptive.integration.step_functions`),
        each traced on its first call."""
        if self._functions is None:
            self._scales.install(self._forward_order())
            probes = self._probe_fn is not None and bool(self.probe_every)
            self._functions = step_functions.StepFunctions(
                self.model, self._optimizer, self._hooks, self._stats.accumulate,
                probe=(lambda batch: self._probe_function()(batch)) if probes else None,
                gateable=self._gateable())
        return self._functions.functions

    # -- Keras hooks -------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._restored, self._first, self._first_start = False, None, 0
        if self._policy is not None and not self._configured:  # no set_params came
            self._configure()

    def on_epoch_begin(self, epoch, logs=None):
        if self._inert:
            return
        if not self._restored:
            # Not in on_train_begin: BackupAndRestore may restore after us there.
            schedule = self._restore_from_variables()
            self._restored = True
            self._first = step_functions.first_call(  # from scratch: judge early
                self.first_decision, self.interval, (self.params or {}).get("steps"), self._calls,
                self._expected)
            if schedule and self.first_decision:  # a judgement the restored run had due soon
                self._first, self._first_start = schedule
            self._state.set_schedule(self._first, self._first_start)
            if timeline.of(self.model) is None:  # the start, for plot_precision
                built = getattr(self._optimizer, "built", False)
                timeline.record(self.model, self._calls, self._optimizer, self._paths,
                                self._scales.layer_loss_scales() if built else None)
        self._epoch_switches = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._inert:
            return
        call, probes = self._calls + 1, self._state.probes
        kind = step_functions.kind_of_call(call, self.statistics_every, self.probe_every,
                                           self._first, self._first_start, probes and probes.next)
        if kind == 2 and probes is not None and probes.due(call):
            self._state.set_probes(probes.probed(call))
        self.model.train_function = self._train_functions()[kind]

    def on_train_batch_end(self, batch, logs=None):
        # Here, not at the next batch's start: callbacks after this one at
        # the epoch's end (BackupAndRestore, ModelCheckpoint) must see the
        # decision of the epoch's last call.
        self.step_end()

    def on_epoch_end(self, epoch, logs=None):
        if self._inert:
            return
        if logs is not None and self.history_logs:
            logs["precision_switches"] = self._epoch_switches
            logs["precision_narrow_layers"] = sum(
                self._policy.dtype_of(p) == self._policy.candidates_for(p)[0]
                for p in self._paths)

    def on_train_end(self, logs=None):
        if self._inert:
            return
        if not self._restored:  # no epoch ran: a backup of the finished run was restored
            self._restore_from_variables()
        # Custom loops and later traces see the statistics on, as after set_model.
        if isinstance(self._optimizer, LossScaleOptimizer):
            self._optimizer.statistics_sink = self._stats.accumulate
        self._hooks.forward = True
        timeline.finish(self.model, self._calls)
        if self._writer is not None:
            self._writer.flush()

    # -- decisions ---------------------------------------------------------

    def step_end(self) -> list[dict[str, Any]]:
        """Counts one train step (``fit`` calls it after each); every ``interval`` calls,
        decides. Returns the switches made now (usually none)."""
        if self._policy is None:
            raise ValueError("Call set_model(model) before step_end().")
        if self._inert:
            return []
        self._calls += 1
        self._policy.calls = self._calls  # saved with the policy
        if self._calls % self.interval and self._calls != self._first:
            return []
        return self.update()

    def probe(self, data) -> None:
        """Runs the float32 probe on one batch (custom loops; ``fit`` probes by itself). Nothing
        is applied; the result joins the interval's statistics.

        Args:
            data: a batch, ``x``, ``(x, y)`` or ``(x, y, sample_weight)``.
        """
        if self._policy is None:
            raise ValueError("Call set_model(model) before probe().")
        if self._inert:
            return
        self._probe_function()(data)

    def update(self) -> list[dict[str, Any]]:
        """Decides now on the statistics accumulated since the last decision,
        applies the switches and starts a new interval.

        Returns:
            The switches made, as dicts (see :attr:`events`).
        """
        if self._inert:
            return []
        interval = self._stats.read()
        self._stats.reset()
        if interval.steps == 0 and interval.probe_steps == 0:
            return []
        policy = self._policy
        order = self._forward_order()
        states = self._states()
        probes = self._probe_fn is not None and self.probe_every is not None
        decision = controller.decide(
            [interval.layers[i] for i in order], [states[i] for i in order],
            policy.candidates, policy.rule, all_nonfinite=interval.all_nonfinite,
            probe_steps=interval.probe_steps, probe_loss_error=interval.probe_loss_error,
            probe_loss_noise_ratio=interval.probe_loss_noise_ratio,
            validate_demotions=probes, confirm_proxies=probes,
            float8_layers=[policy.is_float8(self._paths[i]) for i in order],
            parents=switching.parents([self._paths[i] for i in order]),
            **self._scales.arguments(order))
        self.scale_events += self._scales.apply(decision, order, self._calls,
                                                verbose=self.verbose)
        new_states = list(states)
        for k, st in zip(order, decision.states):
            new_states[k] = st
        switches = [(order[sw.layer], sw.old, sw.new, sw.reason) for sw in decision.switches]
        switches += switching.with_parents(policy, self._paths, switches, new_states)
        made = switching.apply(policy, self._paths, self._layers, switches, self._calls,
                               verbose=self.verbose)
        trials_changed = [s.trial for s in states] != [s.trial for s in new_states]
        switching.write_records(policy, self._paths, new_states, interval, order)
        self._scales.write_records(policy)
        self._state.write(new_states, policy.candidates, self._calls)
        self.events.extend(made)
        self._epoch_switches += len(made)
        if self.first_decision and any(sw.reason in _NONFINITE for sw in decision.switches):
            # Steps are being skipped: judge again soon, not an interval later
            # (an overflow hides the next one downstream until it is gone).
            self._first_start, self._first = self._calls, self._calls + max(2, self.first_decision // 4)
            self._state.set_schedule(self._first, self._first_start)  # a resumed run judges too
        timeline.record(self.model, self._calls, self._optimizer, self._paths,
                        self._scales.layer_loss_scales())
        if self.log_dir is not None:  # TensorBoard
            self._writer = self._writer or tf.summary.create_file_writer(self.log_dir)
            tensorboard.write_interval(self._writer, self._calls, policy, self._paths, interval,
                                       len(made), loss_scales=self._scales.layer_loss_scales())
        if self._state.probes is not None:  # probes back off while they confirm
            calm = not (made or trials_changed or interval.all_nonfinite or any(
                s.trial for s in new_states) or any(x.nonfinite for x in interval.layers))
            self._state.set_probes(self._state.probes.decided(
                self._calls, probed=interval.probe_steps > 0, confirmed=calm))
        if made or trials_changed:
            self._rebuild()
        return made

    def _forward_order(self) -> list[int]:
        """Layer indices in forward order (as last traced), input first."""
        seen = [i for i in self._hooks.call_order if i < len(self._paths)]
        return seen + [i for i in range(len(self._paths)) if i not in seen]
