"""``training_args.bin``: ``torch.save`` of a TrainingArguments object of any class (the Trainer's, TRL's configs,
axolotl's ``AxolotlTrainingArguments``, Unsloth's generated ``UnslothSFTConfig``, LLaMA-Factory's, swift's), read by
an unpickler that builds nothing of the file's: every class it names is an inert stand-in made here, never imported.

What the pickle may hold, and what each becomes:

* a class of a tool (any module outside Python's standard library; a name that is a class, ``CapWords``): a stand-in
  that records what pickle hands it — its state (a dataclass's fields: a plain dict), the one value it was called
  with (an enum member pickled by value, ``IntervalStrategy('steps')``: ``'steps'``), or the values it was called
  with, as a list (vLLM's ``SamplingParams`` in Unsloth's GRPO config);
* an enum member pickled by name — ``getattr(SchedulerType, 'COSINE')`` (protocol 2's way to reach
  ``Class.MEMBER``, and ``enum.pickle_by_enum_name``) or the dotted global ``SchedulerType.COSINE`` (protocol 4): its
  value, read from the enum's source where that library is installed (parsed as text, never run), else its name;
* ``torch.device`` (``cuda:3``), a torch dtype (``torch.bfloat16``), ``collections.OrderedDict``, ``set``,
  ``frozenset``, ``pathlib`` paths, ``datetime``'s date, datetime and timedelta, bytes (protocol 2 writes them as
  ``_codecs.encode(text, 'latin1')``), a numpy scalar of a number (``numpy.float64``): plain values built here.

Anything else is refused in one line naming it: a function (``os.system``, ``builtins.eval``), any other name of the
standard library, ``getattr`` on anything but a stand-in class or to a private name, a state that sets an object
twice (pickle's way to plant a ``__setstate__``), a bare class or callable left in the fields, a tensor."""

from __future__ import annotations

import ast
import datetime
import functools
import importlib.util
import io
import pickle
import struct
import sys
import zipfile
from pathlib import Path, PurePosixPath, PureWindowsPath

from finetune.errors import ConfigError

DTYPE_PREFIXES = ("float", "bfloat", "half", "double", "int", "uint", "bool", "complex", "qint", "quint")


class _Refused(pickle.UnpicklingError):
    """What the file holds that is not training arguments: said once, the file refused whole."""


class _Record:
    """A stand-in object of a class the file names: pickle's NEWOBJ/REDUCE hand it its arguments, BUILD its state;
    nothing else of it exists. Its class is made by :func:`_stand_in` (module and qualname kept to say it)."""

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.state, self.items = args, None, {}
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if self.state is not None:  # a second BUILD: how a pickle plants an instance __setstate__ and calls it
            raise _Refused(f"a second state for one {_name(type(self))} object")
        self.state = _fields(state, type(self))

    def __setitem__(self, key, value):  # a dict subclass's items, as pickle's SETITEMS hands them
        self.items[key] = value


class _Member(_Record):
    """An enum member named by its class (``SchedulerType.COSINE``): a value, never called."""

    def __new__(cls, *args, **kwargs):
        raise _Refused(f"a call of {_name(cls)}, an enum member")


def _fields(state, cls) -> dict:
    """A BUILD state as the object's fields: a ``__dict__``, a ``(dict, slots)`` pair, or slots alone."""
    if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
        merged = dict(state[0] or {})
        merged.update(state[1] or {})
        state = merged
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise _Refused(f"a {_name(cls)} object whose state is {type(state).__name__}, not its fields by name")
    return state


def _name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Constructor:
    """One data constructor this reader implements, under the global name a pickle calls it by."""

    def __init__(self, name: str, build):
        self.name, self.build = name, build

    def __call__(self, *args):
        try:
            return self.build(*args)
        except _Refused:
            raise
        except Exception:  # wrong arguments for the type: the file is not what it says
            raise _Refused(f"{self.name} called with {len(args)} argument(s) it does not take") from None


def _device(kind, index=None) -> str:
    """``torch.device('cuda', 3)`` as ``cuda:3`` (an indexed device: a process of a multi-GPU run)."""
    return str(kind) if index is None or ":" in str(kind) else f"{kind}:{index}"


def _ordered_dict(items=()) -> dict:
    return dict(items)


def _as_list(items=()) -> list:
    return list(items)


def _path(*parts) -> str:
    return str(PurePosixPath(*(str(p) for p in parts)))


def _windows_path(*parts) -> str:
    return str(PureWindowsPath(*(str(p) for p in parts)))


def _plain_args(*args):
    """The arguments of a stdlib data type: bytes and numbers only (a datetime's pickled form)."""
    if not all(isinstance(a, (bytes, int, float)) for a in args):
        raise _Refused("a date or time built from something other than bytes and numbers")
    return args


def _latin1(text, encoding=None):
    """``_codecs.encode(text, 'latin1')``: how protocol 2 writes a bytes object."""
    if not isinstance(text, str) or encoding != "latin1":
        raise _Refused("_codecs.encode of anything but text as latin1")
    return text.encode("latin1")


NUMPY_CODES = {"f8": "d", "f4": "f", "f2": "e", "i8": "q", "i4": "i", "i2": "h", "i1": "b", "u8": "Q", "u4": "I",
               "u2": "H", "u1": "B", "b1": "?"}  # numpy's dtype codes of scalars → struct's formats


class _NumpyDtype:
    """``numpy.dtype('f8', False, True)`` and the byte order its BUILD state gives: enough to read one scalar."""

    def __init__(self, code, align=False, copy=True):
        if code not in NUMPY_CODES:
            raise _Refused(f"a numpy dtype {code!r}, not a number's")
        self.code, self.order = code, "<"

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">", "|", "="):
            self.order = {"|": "="}.get(state[1], state[1])  # "|": one byte, no order; "=": this machine's


def _numpy_scalar(dtype, raw):
    """A numpy scalar (``np.float64(2e-4)`` given as a learning rate) as the Python number it holds."""
    if not isinstance(dtype, _NumpyDtype) or not isinstance(raw, bytes):
        raise _Refused("a numpy scalar of something but a number's dtype and bytes")
    return struct.unpack(dtype.order + NUMPY_CODES[dtype.code], raw)[0]


def _member_by_getattr(owner, member):
    """``getattr(EnumClass, 'MEMBER')`` as pickle writes an enum member by name: resolved to the member without
    importing its class. Only a stand-in class and a public name; any other target or name is refused."""
    if not (isinstance(owner, type) and issubclass(owner, _Record)) or issubclass(owner, _Member):
        raise _Refused(f"getattr on {type(owner).__name__}, not on a class of the arguments")
    if not isinstance(member, str) or not member.isidentifier() or member.startswith("_"):
        raise _Refused(f"getattr of {member!r} on {_name(owner)}")
    return _stand_in(owner.__module__, f"{owner.__qualname__}.{member}", owner._classes)


CONSTRUCTORS = {
    ("torch", "device"): _device,
    ("collections", "OrderedDict"): _ordered_dict,
    ("builtins", "dict"): _ordered_dict, ("__builtin__", "dict"): _ordered_dict,  # a dict pickled by its class
    ("builtins", "set"): _as_list, ("builtins", "frozenset"): _as_list,
    ("__builtin__", "set"): _as_list, ("__builtin__", "frozenset"): _as_list,  # protocol 2's names for builtins
    ("builtins", "getattr"): _member_by_getattr, ("__builtin__", "getattr"): _member_by_getattr,
    ("pathlib", "PosixPath"): _path, ("pathlib", "PurePosixPath"): _path, ("pathlib", "Path"): _path,
    ("pathlib", "WindowsPath"): _windows_path, ("pathlib", "PureWindowsPath"): _windows_path,
    ("_codecs", "encode"): _latin1,
    ("numpy", "dtype"): _NumpyDtype,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar, ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("datetime", "datetime"): lambda *a: datetime.datetime(*_plain_args(*a)).isoformat(),
    ("datetime", "date"): lambda *a: datetime.date(*_plain_args(*a)).isoformat(),
    ("datetime", "timedelta"): lambda *a: datetime.timedelta(*_plain_args(*a)).total_seconds(),
}


# typing's special forms, which OmegaConf's ListConfig / DictConfig pickle as their ref_type and element_type (a
# script that hands a Hydra config's list to LoraConfig leaves one in the arguments): read as their names
TYPING_FORMS = frozenset({"Any", "Optional", "Union", "List", "Dict", "Tuple"})


def _stand_in(module: str, qualname: str, classes: dict) -> type:
    """The inert class standing for ``module.qualname`` (one per name in a file, so ``getattr`` on it and ``plain``
    see the same one). A dotted qualname is a member of the class before the dot (an enum member by name)."""
    key = (module, qualname)
    if key not in classes:
        base = _Member if "." in qualname else _Record
        cls = type(qualname.rsplit(".", 1)[-1], (base,), {"__module__": module, "__qualname__": qualname,
                                                          "_classes": classes})
        classes[key] = cls
    return classes[key]


def _is_class_name(qualname: str) -> bool:
    """A class of a tool (``CapWords``), optionally with one member (``SchedulerType.COSINE``): not a function."""
    parts = qualname.split(".")
    return len(parts) <= 2 and all(p.isidentifier() and not p.startswith("_") for p in parts) \
        and parts[0][0].isupper()


def _refuse_global(module: str, name: str) -> str | None:
    """Why ``module.name`` is not a class of training arguments, or None when it may stand in as one."""
    if not all(p.isidentifier() for p in module.split(".")):
        return "not a module's name"
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top == "__builtin__":
        return "a name of Python's standard library"
    if not _is_class_name(name):
        return "a function or other callable, not a class"
    return None


class _ArgsUnpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.classes: dict = {}  # (module, qualname) → its stand-in, for this file

    def find_class(self, module, name):
        if (module, name) in CONSTRUCTORS:
            return _Constructor(f"{module}.{name}", CONSTRUCTORS[module, name])
        if module == "torch" and name.startswith(DTYPE_PREFIXES) and name.isidentifier():
            return f"torch.{name}"  # a dtype: its name (a global read, not a call)
        if module == "typing" and name in TYPING_FORMS:
            return f"typing.{name}"  # an annotation a config library keeps in its fields (OmegaConf's ref_type)
        why = _refuse_global(module, name)
        if why:
            raise _Refused(f"{module}.{name} ({why})")
        return _stand_in(module, name, self.classes)

    def persistent_load(self, pid):
        raise _Refused(f"a tensor storage ({pid!r})")


@functools.lru_cache(maxsize=None)
def _enum_source_values(module: str, qualname: str) -> dict:
    """``NAME = 'value'`` of class ``qualname`` in ``module``'s installed source, parsed as text (nothing imported,
    nothing run); {} when the library is not installed or the class is not written so."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: located, not imported
    except (ImportError, ValueError):
        return {}
    if spec is None or not spec.submodule_search_locations and rest:
        return {}
    base = Path(next(iter(spec.submodule_search_locations))) if spec.submodule_search_locations else None
    candidates = [Path(spec.origin)] if base is None else \
        [base.joinpath(*rest).with_suffix(".py"), base.joinpath(*rest, "__init__.py")]
    source = next((p for p in candidates if p.suffix == ".py" and p.is_file()), None)
    if source is None:
        return {}
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == qualname:
            return {t.id: s.value.value for s in node.body if isinstance(s, ast.Assign)
                    and isinstance(s.value, ast.Constant) for t in s.targets if isinstance(t, ast.Name)}
    return {}


def _member_value(cls: type):
    """An enum member pickled by name (``SchedulerType.COSINE``): its value as its enum's source says, else its
    name."""
    owner, member = cls.__qualname__.rsplit(".", 1)
    return _enum_source_values(cls.__module__, owner).get(member, member)


def plain(value):
    """A value of the arguments with every stand-in replaced by what it held: an object's fields (a dict), an enum
    member's value. A class or callable left as a value is refused: arguments are data."""
    if isinstance(value, _Record):
        if value.state is not None or value.items:
            return {plain(k): plain(v) for k, v in {**value.items, **(value.state or {})}.items()}
        if len(value.args) == 1 and isinstance(value.args[0], (str, int, float, bool)):
            return value.args[0]  # an enum member pickled by value: EnumClass(value)
        if not value.args:
            return {}  # an object with no fields
        # built from its arguments alone (vLLM's SamplingParams, a msgspec struct, reduces to its fields' values in
        # order): those values, as a list — their names are in a class this reader never imports
        return [plain(a) for a in value.args]
    if isinstance(value, type) and issubclass(value, _Member):
        return _member_value(value)
    if isinstance(value, type) and issubclass(value, _Record):
        raise _Refused(f"the class {_name(value)} as a value")
    if isinstance(value, _Constructor):
        raise _Refused(f"the callable {value.name} as a value")
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if value is None or isinstance(value, (str, int, float, bool, bytes)):
        return value
    raise _Refused(f"a {type(value).__name__} value")


def read_training_args_bin(path: Path, what: str = "baseline") -> dict:
    """The fields of a ``training_args.bin`` (:func:`read_arguments`)."""
    return read_arguments(path, what)[1]


def read_arguments(path: Path, what: str = "baseline") -> tuple[str, dict]:
    """(the class's name, its fields) of a ``training_args.bin`` (``torch.save`` of training arguments of any class:
    ``SFTConfig``, ``UnslothGRPOConfig``, …), read by an unpickler that imports and calls nothing of the file's (see
    the module's docstring for what it accepts).

    Raises ConfigError, one line naming what was refused, for anything else or a file that is not a ``torch.save``
    zip of one object."""
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise ConfigError(f"{what}: {path} is not a torch.save file of training arguments")
            data = z.read(names[0])
    except zipfile.BadZipFile:
        if path.read_bytes()[:40].startswith(b"version https://git-lfs"):  # a clone without `git lfs pull`
            raise ConfigError(f"{what}: {path} is a Git LFS pointer, not the file: fetch it (git lfs pull) or give "
                              "training_args.json or the model card") from None
        raise ConfigError(f"{what}: {path} is not a torch.save zip file (training arguments are saved as one since "
                          "torch 1.6); give training_args.json or the model card") from None
    try:
        obj = _ArgsUnpickler(io.BytesIO(data)).load()
        if not isinstance(obj, _Record) or obj.state is None:
            raise ConfigError(f"{what}: {path} does not hold a TrainingArguments object")
        return type(obj).__qualname__.rsplit(".", 1)[-1], {k: plain(v) for k, v in obj.state.items()}
    except pickle.UnpicklingError as e:  # _Refused among them
        raise ConfigError(f"{what}: {path} holds {e}: not training arguments (a class's fields, its enums, plain "
                          "data); refused, nothing from it was run") from None
    except ConfigError:
        raise
    except Exception as e:  # a malformed pickle: said in one line, never run
        raise ConfigError(f"{what}: {path} is not a readable pickle of training arguments ({type(e).__name__})") \
            from None
