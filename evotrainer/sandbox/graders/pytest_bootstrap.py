"""The test process of a `pytest` evaluation (SWE-rebench-style repositories).

It imports the repository's code, so it is untrusted; this program starts it before any of
that code runs. It reads its setup and a fresh key from stdin (then closed), installs an audit
hook that refuses introspection from an edited file and import hooks of the code under test,
snapshots pytest's, pluggy's, importlib's and the builtins' functions, makes the graded test
files' `==`, `!=`, `in` and `not in` comparisons strict (`compare`), runs every graded test
through its own protocol hook and sends each record, signed, on an inherited descriptor.

Why it is written as it is: the code under test shares this interpreter, and Python lets it
rewrite a closure cell, a module attribute or an ordinary class attribute without any audit
event. So no function here reads anything it does not hold itself: every dependency (builtins
and library functions included) is a default argument, and reading or replacing a function's
defaults raises an audit event the hook refuses; containers are frozen; the key and the
channel live in one generator's frame (reaching a frame is refused) and it signs only for
this program's own code; the hook and the signer use C operations alone once untrusted code
may run (a library's Python function reads its module's globals, which the code under test
can replace).

The runner (`evotrainer.sandbox.runner.do_pytest`) runs this file's text with
`python -I -c TEXT` in the repository: the standard library and pytest only, no evotrainer.
"""

import _hashlib
import ast
import json
import os
import sys
import sysconfig
import types

sys.dont_write_bytecode = True  # no cache the next run could take for a source

# The name the graded test files' comparisons call: '@' makes it no identifier a source file
# can write, and it lives in the builtins, whose functions the snapshot covers.
COMPARE = "@evotrainer_compare"


def _boot(setup):
    realpath = os.path.realpath
    repo = realpath(os.getcwd())
    edited = frozenset(repo + os.sep + path for path in setup["edited"])
    # sha256 of each Python file of the repository as it stood before the test process
    # started (the runner's digests): a compile of exactly that text under that file's name
    # is the file's own module being loaded, whoever runs the import.
    sources = frozenset((repo + os.sep + path, digest)
                        for path, digest in setup["sources"].items())
    wanted = frozenset(setup["tests"])
    graded = frozenset(realpath(repo + os.sep + test.split("::")[0]) for test in wanted)
    stdlib = tuple(realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
    # Standard modules that hand their caller frames, raw memory or files: an event inside
    # one of them is its caller's doing. Any other standard module (typing, logging,
    # traceback...) reads frames for itself.
    passing = frozenset(
        prefix + name for prefix in stdlib for name in (
            "inspect.py", "ctypes/__init__.py", "pathlib.py", "os.py", "io.py", "glob.py",
            "shutil.py", "codecs.py", "operator.py", "functools.py"))
    watched = frozenset({
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe",
        "sys._current_frames", "sys.settrace", "sys.setprofile", "sys.addaudithook",
        "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.addressof",
        "ctypes.string_at", "ctypes.wstring_at", "ctypes.cdata", "object.__getattr__",
        "object.__setattr__", "object.__delattr__", "open", "os.listdir", "os.scandir",
        "compile", "code.__new__", "function.__new__", "import", "exec"})
    # The standard library's class builders: they compile text of their own making (from a
    # class's field names) into its __init__, __eq__, __repr__...
    builders = frozenset(prefix + name for prefix in stdlib
                         for name in ("dataclasses.py", "collections/__init__.py"))
    frame_attrs = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})

    def signing(key, channel, digest=_hashlib.hmac_digest, getframe=sys._getframe,
                frozenset=frozenset, str=str):
        # Records are "n<TAB>kind<TAB>fields..." with tabs and newlines in a field made spaces,
        # built with str operations alone; the first message names the code allowed to send.
        line, count, senders = None, 0, None
        while True:
            kind, fields = yield line
            if senders is None:
                senders = frozenset(fields)
                continue
            caller = getframe(1).f_back
            if caller is None or caller.f_code not in senders:
                where = caller.f_code.co_filename if caller is not None else "?"
                kind, fields = "tampered", ("the grader's send called from " + where,)
            body = "\t".join([str(count), kind, *[
                str(f).replace("\t", " ").replace("\n", " ") for f in fields]])
            channel.write(digest(key, body.encode(), "sha256").hex() + " " + body + "\n")
            channel.flush()
            count += 1

    signer = signing(bytes.fromhex(setup.pop("key")), os.fdopen(setup["fd"], "w"))
    next(signer)

    def send(kind, *fields, signer=signer):
        signer.send((kind, fields))

    own = set()  # ids of this program's functions: their defaults are not for others to read

    # ids of pytest's, pluggy's, importlib's and the builtins' classes (filled below): their
    # members are in the snapshot, so what they hold is checked there.
    guarded = set()

    # Code a class builder made for a class defined outside the edited files (a library's
    # dataclass): ids, and the code objects themselves, kept so that no id is reused.
    generated, generated_codes = set(), []

    def untrusted(code, edited=edited, own_codes=frozenset(), generated=generated, id=id):
        # Code from an edited file, or compiled from a string (no file stands behind it)
        # other than what a class builder made for a class of the unedited code.
        path = code.co_filename
        return code not in own_codes and (path in edited or (
            path.startswith("<") and not path.startswith("<frozen")
            and id(code) not in generated))

    # Reads that no class can redirect: a type's own __dict__ and __mro__, an instance's dict.
    type_dict = type.__dict__["__dict__"].__get__
    type_mro = type.__dict__["__mro__"].__get__
    instance_get = object.__getattribute__
    code_kinds = (types.FunctionType, staticmethod, classmethod, property)

    def foreign(value, depth=3, untrusted=untrusted, guarded=guarded, type_dict=type_dict,
                type_mro=type_mro, instance_get=instance_get, code_kinds=code_kinds,
                type=type, id=id, list=list, issubclass=issubclass, str=str,
                FunctionType=types.FunctionType, MethodType=types.MethodType):
        # The file of the code under test that `value` is, runs or holds (a function, its
        # closure and defaults, a class's methods, an instance's class and own functions,
        # classes and tuples of them), else None. Only C operations touch `value` itself:
        # no property, __getattr__ or __class__ of theirs runs here.
        kind = type(value)
        if kind is FunctionType:
            code = value.__code__
            if untrusted(code):
                return code.co_filename
            inner = list(value.__defaults__ or ())
            for cell in value.__closure__ or ():
                try:  # noqa: SIM105 - no library function may run here (see the hook)
                    inner.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            for item in inner:
                found = depth and foreign(item, depth - 1)
                if found:
                    return found
            return None
        if kind is MethodType:
            return foreign(value.__func__, depth) or (depth and foreign(value.__self__,
                                                                         depth - 1)) or None
        if kind in (tuple, list):
            for item in list(value):
                found = depth and foreign(item, depth - 1)
                if found:
                    return found
            return None
        if kind in (str, bytes, int, float, bool, type(None)):
            return None
        for klass in [kind] + ([value] if issubclass(kind, type) else []):
            if id(klass) in guarded:
                continue
            for base in type_mro(klass):
                if id(base) in guarded:
                    continue
                for member in list(type_dict(base).values()):
                    if issubclass(type(member), code_kinds):
                        if type(member) is property:
                            parts = [member.fget, member.fset, member.fdel]
                        elif type(member) is FunctionType:
                            parts = [member]
                        else:
                            parts = [member.__func__]
                        for part in parts:
                            if type(part) is FunctionType and untrusted(part.__code__):
                                return part.__code__.co_filename
            if klass is not value and type(klass) is not type and depth:
                found = foreign(type(klass), depth - 1)  # the metaclass
                if found:
                    return found
        if issubclass(kind, type) or not depth:
            return None
        try:
            own_dict = instance_get(value, "__dict__")
        except AttributeError:
            return None
        if type(own_dict) is not dict:
            return None
        for item in list(own_dict.values()):
            if type(item) in (FunctionType, MethodType, tuple, list) or issubclass(type(item),
                                                                                   type):
                found = foreign(item, depth - 1)
                if found:
                    return found
        return None

    def import_hooks(meta_path, path_hooks, cache=None, foreign=foreign, list=list,
                     type=type, str=str):
        # Import hooks of the code under test: an entry of sys.meta_path or sys.path_hooks
        # (or a finder in sys.path_importer_cache) that is, runs or holds its code. Such a
        # hook can hand pytest a test module compiled from other text than the file's.
        found = []
        for name, hooks in (("sys.meta_path", meta_path), ("sys.path_hooks", path_hooks),
                            ("sys.path_importer_cache", cache)):
            if type(hooks) is dict:
                hooks = list(hooks.values())
            if type(hooks) is not list:
                continue
            for entry in list(hooks):
                where = foreign(entry)
                if where:
                    found.append("an import hook from " + str(where) + " in " + name)
        return found

    def loads_itself(source, filename, sources=sources, sha256=_hashlib.openssl_sha256,
                     type=type, str=str, bytes=bytes, encode=str.encode):
        # Whether `source` is the text `filename` held when the grading began: compiling it
        # under that name makes the file's own code (what importing the module does), no
        # borrowed provenance. A file written or changed since does not count.
        if type(filename) is not str:
            return False
        if type(source) is str:
            source = encode(source, "utf-8", "surrogatepass")
        elif type(source) is not bytes:  # an AST, a buffer: the text is not the file's
            return False
        return (filename, sha256(source).hexdigest()) in sources

    def hook(event, args, watched=watched, frame_attrs=frame_attrs, edited=edited,
             passing=passing, getframe=sys._getframe, send=send, id=id, str=str, bytes=bytes,
             type=type, len=len, FunctionType=types.FunctionType, own=own, guarded=guarded,
             import_hooks=import_hooks, loads_itself=loads_itself, sysmod=sys,
             builders=builders, generated=generated, generated_codes=generated_codes,
             CodeType=types.CodeType, reported=set(), busy=[False]):  # noqa: B006
        # Nothing here may run code the code under test can define (a property, __eq__,
        # __class__, __hash__ of its objects): while `busy`, the hook is off. So values of
        # untrusted types are only compared by type and identity.
        if event not in watched or busy[0]:
            return
        busy[0] = True
        culprit = None
        try:
            target = args[0] if args else None
            kind = type(target)
            compiles = event == "compile" and (type(args[1]) is not str
                                               or not args[1].startswith("<"))
            if event == "exec":
                # A class builder running its text: the code is the builder's own making
                # unless the class it builds is defined in an edited file (or by code
                # compiled from a string there).
                frame = getframe(1)
                if (type(target) is CodeType and frame is not None
                        and frame.f_code.co_filename in builders):
                    while frame is not None and (frame.f_code.co_filename in builders
                                                 or frame.f_code.co_filename in passing
                                                 or frame.f_code.co_filename.startswith("<")):
                        frame = frame.f_back
                    if frame is not None and frame.f_code.co_filename not in edited:
                        codes = [target]
                        while codes:
                            code = codes.pop()
                            generated_codes.append(code)
                            generated.add(id(code))
                            codes.extend(c for c in code.co_consts if type(c) is CodeType)
                relevant = False
            elif event == "import" or compiles:
                # An import statement that reaches the finders passes here first, and every
                # module compiled from a file (importlib.import_module raises no import
                # event) passes at its compile: a hook of the code under test is refused
                # before its module runs, even one that removes itself after use.
                found = (import_hooks(args[3], args[4]) if event == "import" and len(args) > 4
                         else import_hooks(sysmod.meta_path, sysmod.path_hooks,
                                           sysmod.path_importer_cache) if compiles else [])
                if found:
                    culprit = found[0]
                    if culprit not in reported:
                        reported.add(culprit)
                        send("tampered", culprit)
                # A module of the repository compiled from its own text (an edited module
                # importing a sibling not loaded yet) is a module load, not the importer's
                # doing; any other text under a file's name is a borrowed provenance.
                relevant = compiles and culprit is None and not loads_itself(args[0], args[1])
            elif event in ("object.__getattr__", "object.__setattr__", "object.__delattr__"):
                name = args[1]
                ours = kind is FunctionType and id(target) in own
                if event == "object.__getattr__":
                    relevant = type(name) is str and (name in frame_attrs or (ours and name in (
                        "__defaults__", "__kwdefaults__", "__closure__")))
                else:  # raised for a function's or a class's special attributes
                    relevant = name == "__code__" or ours or id(target) in guarded
            elif event == "compile":  # compiled under a file's name: a borrowed provenance
                relevant = compiles
            elif event in ("open", "os.listdir", "os.scandir"):  # the path, as text
                relevant = (kind is str and target.startswith("/proc")) or (
                    kind is bytes and target.startswith(b"/proc"))
            else:
                relevant = True
            if relevant:
                # The first frame outside the passing standard modules and outside code
                # compiled from a string decides: what `exec` runs is its caller's doing.
                frame = getframe(1)
                while frame is not None and (frame.f_code.co_filename in passing
                                             or frame.f_code.co_filename.startswith("<")):
                    frame = frame.f_back
                if frame is not None and frame.f_code.co_filename in edited:
                    culprit = frame.f_code.co_filename
                    send("tampered", event + " from " + culprit)
        finally:
            busy[0] = False
        if culprit is not None:
            raise PermissionError(event + " is not allowed in the code under test")

    sys.addaudithook(hook)
    try:  # before the repository is on the path: only the environment can fail this
        import _pytest.assertion.rewrite
        import _pytest.main
        import _pytest.python
        import _pytest.reports
        import pluggy  # noqa: F401 - in sys.modules for the snapshot
        import pytest
        from _pytest.runner import runtestprotocol
    except ImportError as err:
        signer.send((None, (_boot.__code__,)))
        send("error", "pytest cannot be imported in the test environment: " + str(err))
        return
    import builtins
    import importlib.machinery  # noqa: F401 - in sys.modules for the snapshot
    sys.path.insert(0, repo)

    # Comparisons in the graded test files: `a == b`, `a != b`, `a in b` and `a not in b`
    # become `@evotrainer_compare(a, b, op)`. Values of the environment's and the standard
    # types compare as Python compares them; an object whose __eq__ or __ne__ is the code
    # under test's cannot bend the verdict: a subclass of a builtin type compares by its
    # builtin value, any other such object must not claim equality with a private sentinel
    # (an object equal to everything is tampering) nor with another value of the expected
    # side's type.
    builtin_bases = (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)
    as_builtin = {
        int: lambda v: int.__add__(v, 0), float: lambda v: float.__add__(v, 0.0),
        complex: lambda v: complex.__add__(v, 0j), str: str.__str__,
        bytes: lambda v: bytes.__getitem__(v, slice(None)),
        tuple: lambda v: tuple.__getitem__(v, slice(None)),
        list: lambda v: list.__getitem__(v, slice(None)), dict: dict.copy, set: set.copy,
        frozenset: frozenset.copy}
    exact = frozenset({bool, int, float, complex, str, bytes, tuple, list, dict, set,
                       frozenset, type(None)})
    slots = (type(object.__eq__), type(object.__init__), type(len), type(str.join))

    def bent(kind, guarded=guarded, type_mro=type_mro, type_dict=type_dict, foreign=foreign,
             untrusted=untrusted, slots=slots, id=id, type=type,
             FunctionType=types.FunctionType):
        # Whether objects of `kind` compare by code of the code under test (their __eq__
        # or __ne__, their class's or a base's).
        if id(kind) in guarded:
            return False
        for base in type_mro(kind):
            if id(base) in guarded:
                continue
            members = type_dict(base)
            for name in ("__eq__", "__ne__"):
                if name in members:
                    member = members[name]
                    if type(member) is FunctionType:
                        if untrusted(member.__code__):
                            return True
                    elif type(member) not in slots and (member is None or foreign(member)):
                        return True
        return False

    def builtin_of(value, bent=bent, builtin_bases=builtin_bases, as_builtin=as_builtin,
                   exact=exact, type_mro=type_mro, type=type):
        # A bent subclass of a builtin type as its builtin value (its overrides dropped).
        kind = type(value)
        if kind in exact or not bent(kind):
            return value
        for base in type_mro(kind):
            if base in builtin_bases:
                return as_builtin[base](value)
        return value

    def holds_bent(value, budget, bent=bent, exact=exact, type=type, list=list,
                   issubclass=issubclass):
        # Whether `value` or anything in its builtin containers compares by bent code;
        # `budget` ([count]) bounds the walk, and past it the answer is yes (the strict
        # comparison is exact for honest values, only slower).
        stack = [value]
        while stack:
            budget[0] -= 1
            if budget[0] < 0:
                return True
            item = stack.pop()
            kind = type(item)
            if kind not in exact and bent(kind):
                return True
            if issubclass(kind, dict):
                stack.extend(dict.keys(item))
                stack.extend(dict.values(item))
            elif issubclass(kind, (list, tuple)):
                stack.extend((list.__iter__ if issubclass(kind, list)
                              else tuple.__iter__)(item))
            elif issubclass(kind, (set, frozenset)):
                stack.extend((set.__iter__ if issubclass(kind, set)
                              else frozenset.__iter__)(item))
        return False

    def perturbed(value, type=type):
        # A value of `value`'s type that does not equal it, when one is at hand.
        kind = type(value)
        if kind is bool:
            return not value
        if kind in (int, float, complex):
            for candidate in (value + 1, value * 2 + 1, -value - 1):
                if candidate != value:
                    return candidate
            return 0 if value == value else 1  # NaN: the one value unequal to itself
        if kind in (str, bytes):
            return value + ("\0" if kind is str else b"\0")
        if kind in (tuple, list):
            return value + kind([object()])
        if kind is dict:
            return {**value, object(): None}
        return None

    def equal(left, right, send=send, bent=bent, builtin_of=builtin_of, exact=exact,
              perturbed=perturbed, type=type, len=len, bool=bool, zip=zip, dict=dict,
              object=object, str=str, all=all, Exception=Exception):
        # Equality where the code under test's comparisons decide nothing on their own.
        for value in (left, right):
            if type(value) not in exact and bent(type(value)):
                try:  # a private sentinel: no honest __eq__ calls it equal
                    everything = bool(value == object())
                except Exception:  # an honest __eq__ may refuse an object it does not know
                    everything = False
                if everything:
                    send("tampered", "an object of " + str(type(value).__qualname__)
                         + " compares equal to everything")
                    return False
        left, right = builtin_of(left), builtin_of(right)
        kinds = (type(left), type(right))
        if kinds[0] is kinds[1] and kinds[0] in (list, tuple):
            return len(left) == len(right) and all(
                equal(a, b) for a, b in zip(left, right))
        if kinds[0] is kinds[1] is dict:
            return dict.keys(left) == dict.keys(right) and all(
                equal(dict.__getitem__(left, k), dict.__getitem__(right, k))
                for k in dict.keys(left))
        bends = [kind not in exact and bent(kind) for kind in kinds]
        if not any(bends) or all(bends):  # none, or the code under test's on both sides
            return bool(left == right)
        mine, other = (left, right) if bends[0] else (right, left)
        if not bool(mine == other):
            return False
        different = perturbed(other)
        if different is None:
            return True
        try:  # equal to the expected value and to another of its type: to neither
            return not bool(mine == different)
        except Exception:
            return True

    def compare(left, right, op, equal=equal, holds_bent=holds_bent, builtin_of=builtin_of,
                type=type, any=any, list=list, tuple=tuple, set=set, frozenset=frozenset,
                dict=dict):
        if op in ("==", "!="):
            if not holds_bent(left, [1 << 20]) and not holds_bent(right, [1 << 20]):
                return left == right if op == "==" else left != right
            same = equal(left, right)
            return same if op == "==" else not same
        if not holds_bent(left, [1 << 20]) and not holds_bent(right, [1 << 20]):
            return left in right if op == "in" else left not in right
        container = builtin_of(right)
        if type(container) in (list, tuple, set, frozenset, dict):
            found = any(equal(left, item) for item in list(container))
        else:
            found = left in right
        return found if op == "in" else not found

    builtins.__dict__[COMPARE] = compare
    operators = {ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in"}
    rewritten = set()  # the graded files whose comparisons were made strict

    def strict(node, operators=operators, type=type, list=list, isinstance=isinstance,
               getattr=getattr, setattr=setattr, enumerate=enumerate, len=len, AST=ast.AST,
               Compare=ast.Compare, Call=ast.Call, Name=ast.Name, Load=ast.Load,
               Constant=ast.Constant, copy_location=ast.copy_location):
        # The tree with every one-operator comparison that `operators` names made a call.
        for field in type(node)._fields:
            value = getattr(node, field, None)
            if type(value) is list:
                for index, item in enumerate(list(value)):
                    if isinstance(item, AST):
                        value[index] = strict(item)
            elif isinstance(value, AST):
                setattr(node, field, strict(value))
        if type(node) is Compare and len(node.ops) == 1 and type(node.ops[0]) in operators:
            call = Call(Name(COMPARE, Load()), [node.left, node.comparators[0],
                                                Constant(operators[type(node.ops[0])])], [])
            return copy_location(call, node)
        return node

    rewrite_asserts = _pytest.assertion.rewrite.rewrite_asserts

    def rewriting(mod, source, module_path=None, config=None, rewrite_asserts=rewrite_asserts,
                  strict=strict, graded=graded, rewritten=rewritten, realpath=realpath,
                  str=str):
        # pytest's assertion rewriting, after the graded files' comparisons are made strict.
        if module_path is not None and realpath(str(module_path)) in graded:
            strict(mod)
            rewritten.add(realpath(str(module_path)))
        return rewrite_asserts(mod, source, module_path, config)

    _pytest.assertion.rewrite.rewrite_asserts = rewriting

    kinds = (type, types.FunctionType, types.BuiltinFunctionType, property, staticmethod,
             classmethod)
    owners = ("_pytest", "pytest", "pluggy", "builtins", "importlib", "_frozen_importlib",
              "_frozen_importlib_external", "zipimport")

    def members(modules=sys.modules, owners=owners, kinds=kinds, vars=vars, list=list,
                isinstance=isinstance, id=id, type=type, FunctionType=types.FunctionType):
        # pytest's, pluggy's, importlib's and the builtins' module-level functions and
        # classes, and their classes' methods and properties: name -> the object.
        found = {}
        for name, module in list(modules.items()):
            if name.split(".")[0] not in owners:
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, (type, FunctionType, types.BuiltinFunctionType)):
                    found[name + "." + attr] = value
                if isinstance(value, type) and value.__module__ == name:
                    for inner, member in list(vars(value).items()):
                        if isinstance(member, kinds):
                            found[name + "." + attr + "." + inner] = member
        return found

    def own_doing(value, untrusted=untrusted, isinstance=isinstance, getattr=getattr,
                  all=all, bool=bool):
        # pytest patches a few of its own classes (legacypath, at configure): a replacement
        # whose code comes from an unedited file is not the code under test's.
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        parts = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
        codes = [getattr(p, "__code__", None) for p in parts if p is not None]
        return bool(codes) and all(c is not None and not untrusted(c) for c in codes)

    snapshot = {name: id(value) for name, value in members().items()}
    holders = frozenset({name.rpartition(".")[0] for name in snapshot} | set(snapshot))
    snapshot = frozenset(snapshot.items())

    def changed(members=members, snapshot=snapshot, holders=holders, own_doing=own_doing,
                import_hooks=import_hooks, sys=sys, id=id, dict=dict, sorted=sorted):
        now, then = members(), dict(snapshot)
        gone = [name for name in then if name not in now]
        return sorted(gone + [
            name for name, value in now.items()
            if then.get(name) != id(value) and not own_doing(value)
            and (name in then or name.rpartition(".")[0] in holders)]) + import_hooks(
            sys.meta_path, sys.path_hooks, sys.path_importer_cache)

    def foreign_hooks(config, untrusted=untrusted, vars=vars, getattr=getattr):
        # Hook implementations from an edited file, compiled from a string or without code.
        found = []
        for caller in vars(config.hook).values():
            for impl in getattr(caller, "get_hookimpls", lambda: [])():
                code = getattr(impl.function, "__code__", None)
                if code is None or untrusted(code):
                    found.append(getattr(impl.function, "__qualname__", "?") + " from "
                                 + (code.co_filename if code is not None else "no code"))
        return found

    class Grader:
        # Runs each test itself (first, in place of pytest's own protocol) and decides its
        # verdict from the reports in hand, after checking pytest is still itself.
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_protocol(self, item, nextitem, runtestprotocol=runtestprotocol,
                                    send=send, changed=changed, foreign_hooks=foreign_hooks,
                                    untrusted=untrusted, wanted=wanted, realpath=realpath,
                                    rewritten=rewritten, real_builtins=builtins.__dict__,
                                    getattr=getattr, vars=vars, all=all, str=str, type=type):
            function = getattr(item, "obj", None)
            code = getattr(function, "__code__", None)
            path = realpath(str(getattr(item, "path", None) or item.fspath))
            if code is not None and untrusted(code):
                send("tampered", item.nodeid + " runs code from an edited file")
            elif item.nodeid in wanted and (
                    code is None or code.co_name != getattr(item, "originalname", None)
                    or realpath(code.co_filename) != path):
                send("tampered", item.nodeid + " does not run its own test function")
            elif item.nodeid in wanted and (
                    path not in rewritten or COMPARE in getattr(function, "__globals__", {})
                    or getattr(function, "__builtins__", real_builtins) is not real_builtins):
                send("tampered", item.nodeid + " does not run the grader's comparisons")
            if "runtest" in vars(item):
                send("tampered", item.nodeid + "'s runtest was replaced")
            item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            reports = runtestprotocol(item, nextitem=nextitem)
            item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
            problems = changed() + foreign_hooks(item.config)
            if problems:
                send("tampered", "changed during " + item.nodeid + ": " + ", ".join(problems[:5]))
            elif item.nodeid in wanted:
                outcomes = {report.when: report.outcome for report in reports
                            if type(report.when) is str}
                passed = all(type(outcomes.get(w)) is str and outcomes[w] == "passed"
                             for w in ("setup", "call", "teardown"))
                send("test", item.nodeid, "pass" if passed else "fail")
            return True

    protocol = Grader.pytest_runtest_protocol
    untrusted.__defaults__ = (edited, frozenset({protocol.__code__}), generated, id)
    own.update(id(f) for f in (send, hook, members, untrusted, own_doing, changed,
                                foreign_hooks, protocol, foreign, import_hooks, loads_itself,
                                bent, builtin_of, holds_bent, perturbed, equal, compare,
                                strict, rewriting))
    guarded.update(id(v) for v in members().values() if isinstance(v, type))
    guarded.add(id(Grader))
    signer.send((None, (protocol.__code__, hook.__code__, _boot.__code__, equal.__code__)))
    send("begin")
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-o", "addopts=",
                        "--assert=rewrite", *setup["tests"]], plugins=[Grader()])
    problems = changed()
    if problems:
        send("tampered", "changed by the end: " + ", ".join(problems[:5]))
    send("end", str(int(code)))


if __name__ == "__main__":
    _boot(json.loads(sys.stdin.readline()))
