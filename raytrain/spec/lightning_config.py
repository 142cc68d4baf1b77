"""LightningCLI's keys of a spec, read by LightningCLI's own parser (jsonargparse).

``model``, ``data`` (a DataModule), ``optimizer``, ``lr_scheduler``, ``trainer.callbacks``,
``trainer.logger`` and the other Trainer arguments written beside raytrain's are handed to a
``LightningArgumentParser`` set up exactly as ``LightningCLI`` sets up its own: a bare
instance of ``LightningCLI`` (or of the project's subclass, ``lightning_cli: module:MyCLI``)
runs its ``init_parser`` and ``_add_arguments`` (seed, Trainer, model and data in subclass
mode, the project's ``add_arguments_to_parser`` and ``link_arguments``, the automatic
optimizer and scheduler). So every nested ``class_path`` becomes an object, types are
checked from the classes' signatures, and the errors are jsonargparse's own, condensed here
to one line that names the full field path (``model.init_args.backbone.init_args.x``).

Where each half runs:

- the driver parses (``config_problems``), it does not instantiate. jsonargparse reads each
  class's signature, so the driver imports Lightning, jsonargparse and the module of every
  class the config names, nested ones included (the model's, the DataModule's, the
  callbacks', the loggers', the optimizer's and the scheduler's, and the CLI subclass's):
  module-level code of those modules runs there; no constructor does.
- each worker parses again and instantiates (``instantiate``): objects are built where they
  train, with ``apply_on="instantiate"`` links (``data.num_classes`` → ``model``) applied,
  LightningCLI's instantiators (so ``save_hyperparameters`` records the config, as under
  ``LightningCLI``) and its automatic ``configure_optimizers``.

raytrain's own sections (``data.train``, ``scaling``, ``checkpoint``, ...) and raytrain's
own Trainer fields (``max_epochs``, ``precision``, ``seed``, ...) are never given to the
parser: they stand beside LightningCLI's keys, read by the spec's own sections.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain import storage
from raytrain.errors import SpecError, root_cause
from raytrain.spec import ClassSpec, DataModuleSpec, JobSpec
from raytrain.util.imports import import_object

if TYPE_CHECKING:
    from jsonargparse import Namespace
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
    from torch.optim import Optimizer


def _entry(section: ClassSpec) -> dict[str, Any]:
    """A spec's class section as LightningCLI writes it: a dotted class path."""
    entry = {
        "class_path": section.class_path.replace(":", "."),
        "init_args": dict(section.init_args),
    }
    if section.dict_kwargs:
        entry["dict_kwargs"] = dict(section.dict_kwargs)
    return entry


def cli_tree(spec: JobSpec, logs_under: str | None = None) -> dict[str, Any]:
    """The LightningCLI config of ``spec``: what ``LightningCLI``'s parser reads.

    ``logs_under``: a folder a logger's relative ``save_dir`` (default ``logs``) is put
    under (the run's folder in checkpoint.storage; the workers set it)."""
    tree: dict[str, Any] = {"model": _entry(spec.model)}
    if isinstance(spec.data, DataModuleSpec):
        tree["data"] = _entry(spec.data)
    if spec.optimizer is not None:
        tree["optimizer"] = _entry(spec.optimizer)
    if spec.lr_scheduler is not None:
        tree["lr_scheduler"] = _entry(spec.lr_scheduler)
    trainer = dict(spec.trainer.passthrough)
    if spec.trainer.callbacks:
        trainer["callbacks"] = [_entry(c) for c in spec.trainer.callbacks]
    loggers = [_entry(c) for c in spec.trainer.logger]
    if logs_under is not None:
        for logger in loggers:
            save_dir = str(logger["init_args"].get("save_dir", "logs"))
            if storage.is_relative_path(save_dir):
                logger["init_args"]["save_dir"] = storage.join(logs_under, save_dir)
    if loggers:
        trainer["logger"] = loggers
    if trainer:
        tree["trainer"] = trainer
    return tree


def needs_lightning(spec: JobSpec) -> bool:
    """Whether the config names classes beside a plain model (a DataModule, callbacks,
    loggers, an optimizer, a CLI class, or a ``class_path`` nested in ``model.init_args``):
    then the driver parses it before Ray starts; a plain model's arguments are parsed while
    Ray starts (``preflight.check_model``), as its import always was."""
    return bool(
        isinstance(spec.data, DataModuleSpec)
        or spec.trainer.callbacks
        or spec.trainer.logger
        or spec.optimizer is not None
        or spec.lightning_cli is not None
        or _nests_class(spec.model.init_args)
    )


def _nests_class(value: object) -> bool:
    if isinstance(value, dict):
        return "class_path" in value or any(_nests_class(v) for v in value.values())
    if isinstance(value, list):
        return any(_nests_class(v) for v in value)
    return False


def build_parser(cli_path: str | None) -> tuple[LightningCLI, LightningArgumentParser]:
    """A ``LightningCLI`` (``cli_path``'s subclass, or LightningCLI itself) and its parser,
    set up as ``LightningCLI.__init__`` sets them up with ``run=False``: model and data in
    subclass mode (the config gives their ``class_path``), no config saving. The CLI's
    ``__init__`` is not run (it would parse ``sys.argv`` and train)."""
    from lightning.pytorch import LightningDataModule, LightningModule, Trainer
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    cls: Any = LightningCLI
    if cli_path is not None:
        path = cli_path if ":" in cli_path else ":".join(cli_path.rsplit(".", 1))
        try:
            cls = import_object(path)
        except (Exception, SystemExit) as exc:  # a module may call sys.exit at import
            raise SpecError(
                f"lightning_cli: cannot import {cli_path!r}: {type(exc).__name__}: {exc}"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, LightningCLI)):
            raise SpecError(
                f"lightning_cli: {cli_path!r} is not a lightning.pytorch.cli.LightningCLI subclass"
            )
    cli = cls.__new__(cls)
    # LightningCLI.__init__'s attributes, for a CLI given no model or data class
    cli.save_config_callback, cli.save_config_kwargs = None, {}
    cli.trainer_class, cli.trainer_defaults = Trainer, {}
    cli.seed_everything_default, cli.parser_kwargs = True, {}
    cli.parser_class, cli.auto_configure_optimizers = LightningArgumentParser, True
    cli.model_class, cli._model_class, cli.subclass_mode_model = None, LightningModule, True
    cli.datamodule_class, cli._datamodule_class = None, LightningDataModule
    cli.subclass_mode_data, cli.subcommand = True, None
    try:
        parser = cli.init_parser(exit_on_error=False)
        cli._add_arguments(parser)
    except (Exception, SystemExit) as exc:  # the user's add_arguments_to_parser
        raise SpecError(
            f"lightning_cli: setting up {cls.__qualname__}'s parser failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    cli.parser = parser
    return cli, parser


def parse(parser: LightningArgumentParser, tree: dict[str, Any]) -> Namespace:
    """``tree`` parsed by ``parser`` (a jsonargparse Namespace); raises ``SpecError`` with
    jsonargparse's reason, on one line naming the field."""
    try:  # a copy: jsonargparse turns the tree's list entries into Namespaces as it goes,
        # and ``explain`` reads the tree as written to name an entry by its index
        return parser.parse_object(copy.deepcopy(tree))
    except (Exception, SystemExit) as exc:  # argparse.ArgumentError, or a user module's
        raise SpecError(explain(str(exc), tree)) from None


def config_problems(spec: JobSpec) -> list[str]:
    """Every problem LightningCLI's parser finds in ``spec``'s LightningCLI keys (the
    driver's check: nothing is instantiated)."""
    tree = cli_tree(spec)
    unimportable = import_problems(tree)
    if unimportable:
        return [spec.as_written(p) for p in unimportable]
    try:
        _, parser = build_parser(spec.lightning_cli)
        config = parse(parser, tree)
    except SpecError as exc:
        return [spec.as_written(p) for p in exc.problems]
    return [spec.as_written(p) for p in _checkpoint_subclasses(config) or trial_problems(config)]


# Callbacks from these packages are built on the driver to check their values: Lightning's
# own construct nothing but their settings. A project's callback may start anything.
_TRIED_CALLBACKS = ("lightning.pytorch.", "pytorch_lightning.")


def trial_problems(config: Namespace) -> list[str]:
    """What the constructors of ``config``'s optimizer, scheduler and Lightning's own
    callbacks refuse, each named by its field (``optimizer.init_args: torch.optim.Adam
    refused them: ValueError: Invalid learning rate: -1``).

    jsonargparse checks types, not values: without this, a negative learning rate passed
    ``validate`` and failed on every rank once Ray had started. The optimizer is built over
    a stand-in parameter and the scheduler over it; the model, the DataModule and the
    loggers are not built here (they may load data or open connections)."""
    import torch

    problems: list[str] = []
    stand_in = torch.nn.Parameter(torch.zeros(1))
    optimizer: Optimizer | None = torch.optim.SGD([stand_in], lr=0.1)  # a lone scheduler's
    if config.get("optimizer") is not None:
        built = _tried("optimizer", config.optimizer, [stand_in], problems)
        optimizer = built if built is not None else None
    if config.get("lr_scheduler") is not None and optimizer is not None:
        _tried("lr_scheduler", config.lr_scheduler, optimizer, problems)
    callbacks = _listed((config.get("trainer") or {}).get("callbacks"))
    for index, callback in enumerate(callbacks):
        if str(callback.get("class_path", "")).startswith(_TRIED_CALLBACKS):
            _tried(f"trainer.callbacks.{index}", callback, None, problems)
    return problems


def _tried(where: str, block: Any, first: object, problems: list[str]) -> Any:
    """``block`` (a parsed ``class_path``/``init_args``) built, given ``first`` as its first
    argument unless None; None, and a problem naming ``where``, if its constructor raised."""
    path = str(block.get("class_path"))
    init_args = block.get("init_args")
    kwargs = init_args.as_dict() if init_args is not None else {}
    try:
        cls = import_object(":".join(path.rsplit(".", 1)))
        return cls(**kwargs) if first is None else cls(first, **kwargs)
    except (Exception, SystemExit) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        problems.append(f"{where}.init_args: {path} refused them: {_cut(reason)}")
        return None


def import_problems(node: object, where: str = "") -> list[str]:
    """Each ``class_path`` in ``node`` (a LightningCLI tree, walked to any depth) whose
    module fails to import, named by its field, with the exception's type and message.

    jsonargparse tries every type of a union and reports the exception's message alone
    among its reasons (``trainer.callbacks: boom at import``): neither the field's index,
    nor the class, nor that it was an import. These imports are the ones parsing makes."""
    problems: list[str] = []
    if isinstance(node, dict):
        path = node.get("class_path")
        if isinstance(path, str) and "." in path and ":" not in path:
            try:
                import_object(":".join(path.rsplit(".", 1)))
            except (Exception, SystemExit) as exc:
                problems.append(
                    f"{where}class_path: importing {path!r} failed: {type(exc).__name__}: {exc}"
                )
        for key, value in node.items():
            if key != "class_path":
                problems += import_problems(value, f"{where}{key}.")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            problems += import_problems(value, f"{where}{index}.")
    return problems


def _checkpoint_subclasses(config: Namespace) -> list[str]:
    """A callback deriving from ModelCheckpoint (Lightning's own is read as ``checkpoint``
    before parsing, ``spec.model_checkpoint``) would write checkpoints raytrain neither
    commits nor resumes from: refused, naming it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = _listed((config.get("trainer") or {}).get("callbacks"))
    problems = []
    for index, callback in enumerate(callbacks):
        path = str(callback.get("class_path", ""))
        try:
            cls = import_object(":".join(path.rsplit(".", 1)))
        except Exception:
            continue  # parsed, so importable; nothing to say if not
        if isinstance(cls, type) and issubclass(cls, ModelCheckpoint):
            problems.append(
                f"trainer.callbacks.{index}.class_path: {path} is a "
                "ModelCheckpoint subclass, whose checkpoints raytrain would "
                "neither commit nor resume from: use Lightning's ModelCheckpoint "
                "(read as checkpoint.*) or the checkpoint section"
            )
    return problems


def resolved_tree(spec: JobSpec) -> dict[str, Any]:
    """``spec``'s LightningCLI keys as jsonargparse resolves them (full class paths, every
    default from the signatures), as ``--print_config`` writes them; raises ``SpecError``."""
    import yaml

    _, parser = build_parser(spec.lightning_cli)
    config = parse(parser, cli_tree(spec))
    dumped = yaml.safe_load(parser.dump(config, skip_link_targets=False, format="yaml"))
    given = cli_tree(spec)
    trainer = dumped.get("trainer") or {}
    # only the Trainer arguments the spec gives: raytrain's own fields stand beside them
    dumped["trainer"] = {k: v for k, v in trainer.items() if k in given.get("trainer", {})}
    dumped.pop("seed_everything", None)  # raytrain's trainer.seed
    return {k: v for k, v in dumped.items() if v is not None and v != {}}


def print_config(spec: JobSpec) -> str:
    """The YAML ``--print_config`` prints: LightningCLI's keys as jsonargparse resolves them,
    raytrain's sections beside them (as ``validate`` resolves them), credentials masked."""
    import yaml

    from raytrain.util.redaction import redact_tree

    lightning = resolved_tree(spec)
    exclude = {"model", "optimizer", "lr_scheduler", *({"tune"} if spec.tune is None else ())}
    if isinstance(spec.data, DataModuleSpec):
        exclude.add("data")
    own = spec.model_dump(mode="json", exclude=exclude)
    for key in ("callbacks", "logger"):
        own["trainer"].pop(key, None)
    trainer = {**lightning.pop("trainer", {}), **own.pop("trainer")}
    tree = {"name": own.pop("name"), **lightning, "trainer": trainer, **own}
    return yaml.safe_dump(redact_tree(tree), sort_keys=False)


@dataclass
class UserObjects:
    """What a worker builds from the config: the model (with LightningCLI's automatic
    ``configure_optimizers`` when the config has an ``optimizer``), the DataModule (or
    None), the user's callbacks and loggers."""

    model: Any
    datamodule: Any = None
    callbacks: list[Any] = field(default_factory=list)
    loggers: list[Any] = field(default_factory=list)


def build_model(spec: JobSpec) -> LightningModule:
    """``spec``'s model built as the workers build it (nested classes, the automatic
    optimizer), for what the driver does with trained weights (MLflow's model, ``export``):
    the model alone under LightningCLI's own parser; everything under a project's CLI class,
    whose links on instantiate may give the model a value only the built DataModule has (a
    model built alone took the argument's default: a head of 10, weights of 12)."""
    return instantiate(spec, only_model=spec.lightning_cli is None).model


def instantiate(
    spec: JobSpec, logs_under: str | None = None, only_model: bool = False
) -> UserObjects:
    """Parse ``spec``'s LightningCLI keys and build them, as ``LightningCLI`` does after
    parsing (instantiators, links on instantiate, automatic optimizers); with
    ``only_model``, the model (and its optimizer) alone."""
    cli, parser = build_parser(spec.lightning_cli)
    tree = cli_tree(spec, logs_under)
    if only_model:
        tree = {key: tree[key] for key in ("model", "optimizer", "lr_scheduler") if key in tree}
    cli.config = parse(parser, tree)
    cli._add_instantiators()
    build = getattr(parser, "instantiate", None) or parser.instantiate_classes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            cli.config_init = build(cli.config)
        except Exception as exc:  # a constructor refused: jsonargparse's 9-line union report
            raise SpecError(_refused(exc, tree)) from exc
    cli.model, cli.datamodule = cli.config_init.get("model"), cli.config_init.get("data")
    cli._add_configure_optimizers_method_to_model(None)
    trainer = cli.config_init.get("trainer") or {}
    return UserObjects(
        model=cli.model,
        datamodule=cli.datamodule,
        callbacks=_listed(trainer.get("callbacks")),
        loggers=_listed(trainer.get("logger")),
    )


def _listed(value: object) -> list[Any]:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, list) else [value]


_KEY = re.compile(r'^Parser key "([^"]+)":$')
_CLASS = re.compile(r"^- Problem with given class_path '([^']+)':$")
_OPTION = re.compile(r"^(?:- )?(?:Option|Key) '([^']+)' is not accepted")
_IMPORT = re.compile(
    r"^(Import path |module '|No module named |Problem importing|.* has no attribute )"
)
_NOISE = re.compile(
    r"^(- )?(Does not validate against|Subtypes:|Errors:|Given value|Expected a <class "
    r"'NoneType'>|Not a valid subclass of|Subclass types expect|a class path \(str\)|a dict "
    r"with|a dict without)"
)


def explain(message: str, tree: dict[str, Any]) -> str:
    """jsonargparse's nested error ``message`` as one line: the deepest reason, after the
    full field path to it (``model.init_args.backbone.init_args.hiden_dim: Option
    'hiden_dim' is not accepted``); a list entry is named by its index in ``tree``."""
    stack: list[tuple[int, list[str]]] = []  # (indent, path parts) of open keys/classes
    best: list[str] | None = None
    reasons: list[str] = []
    for raw in message.splitlines():
        text = raw.strip()
        if not text:
            continue
        indent = len(raw) - len(raw.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parts = [p for _, ps in stack for p in ps]
        key, cls = _KEY.match(text), _CLASS.match(text)
        if key:
            stack.append((indent, key.group(1).split(".")))
        elif cls:
            stack.append((indent, _class_parts(tree, parts, cls.group(1))))
        elif not _NOISE.match(text):
            option = _OPTION.match(text)
            where = parts + ([option.group(1)] if option else [])
            reason = text.removeprefix("- ")
            if best is None or len(where) > len(best):
                best, reasons = where, [reason]
            elif where == best and reason not in reasons:
                reasons.append(reason)  # a union's alternatives: each type's reason
    if best is None:
        return " ".join(message.split())
    if _IMPORT.match(reasons[0]):  # the class itself, not its arguments
        best = _class_path_field(tree, best, reasons[0])
    # a reason can quote a whole nested value (1,700 characters)
    return f"{'.'.join(best) or '(config)'}: {_cut('; '.join(reasons))}"


_GIVEN_CLASS = re.compile(r"class_path='([^']+)'")


def _refused(error: BaseException, tree: dict[str, Any]) -> str:
    """A constructor's refusal while jsonargparse instantiated ``tree`` as one line: the
    block of the class it names (jsonargparse's report names no field), then the innermost
    exception, the constructor's own."""
    named = _GIVEN_CLASS.search(str(error))
    where = _block_of(tree, named.group(1)) if named else None
    field = ".".join([*where, "init_args"]) if where is not None else "(config)"
    return f"{field}: {_cut(root_cause(error))}"


def _block_of(node: object, class_path: str, where: tuple[str, ...] = ()) -> list[str] | None:
    """The path to the first block of ``node`` whose ``class_path`` is ``class_path``."""
    if isinstance(node, dict):
        if node.get("class_path") == class_path:
            return list(where)
        items: Any = node.items()
    elif isinstance(node, list):
        items = ((str(i), v) for i, v in enumerate(node))
    else:
        return None
    for key, value in items:
        found = _block_of(value, class_path, (*where, key))
        if found is not None:
            return found
    return None


def _cut(reason: str) -> str:
    return reason[:MAX_REASON] + "..." if len(reason) > MAX_REASON else reason


# The longest reason an error line quotes: the field path before it says where to look.
MAX_REASON = 300


def _class_path_field(tree: dict[str, Any], where: list[str], reason: str) -> list[str]:
    """The ``class_path`` field a problem importing a class is about, from its block's
    path (``...init_args`` or the key itself; a list's entry found by the path named)."""
    if where and where[-1] == "init_args":
        return [*where[:-1], "class_path"]
    node: Any = tree
    for part in where:
        node = node.get(part) if isinstance(node, dict) else None
    named = re.search(r"Import path (\S+)", reason)
    if isinstance(node, list) and named:
        for index, item in enumerate(node):
            path = item.get("class_path") if isinstance(item, dict) else item
            if path == named.group(1):
                return [*where, str(index), "class_path"]
    return [*where, "class_path"]


def _class_parts(tree: dict[str, Any], parts: list[str], class_path: str) -> list[str]:
    """The path parts a class's block adds: its index when the value at ``parts`` is a list
    (``trainer.callbacks.1``), then ``init_args``."""
    node: Any = tree
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, list):
        for index, item in enumerate(node):
            path = item.get("class_path") if isinstance(item, dict) else item
            if isinstance(path, str) and path.endswith(class_path.rsplit(".", 1)[-1]):
                return [str(index), "init_args"]
    return ["init_args"]
