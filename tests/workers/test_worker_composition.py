"""The workers are built by composition (issue 30, item 4): no worker class sits more than two
levels below ``Worker``, none holds a method copied from another class by assignment, and no
registered method is a refusal (a body that only raises, or raises NotImplementedError): a
class that cannot serve a method does not have it."""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from megaflow.single_controller import Worker
from megaflow.single_controller.decorator import registered_methods


def _worker_classes() -> list[type]:
    from megaflow.trainer.roles import ROLE_CLASSES
    from megaflow.workers.megatron_workers import ActorWorker, MegatronWorker
    from megaflow.workers.rollout_worker import RolloutWorker, SplitActorWorker

    return [*ROLE_CLASSES.values(), RolloutWorker, SplitActorWorker, ActorWorker, MegatronWorker]


def _function_node(fn) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef), fn
    return node


def _is_refusal(fn) -> bool:
    """The body (docstring aside) is a single ``raise``, or raises NotImplementedError anywhere."""
    node = _function_node(fn)
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if len(body) == 1 and isinstance(body[0], ast.Raise):
        return True
    return any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in ast.walk(node))


@pytest.mark.parametrize("cls", _worker_classes(), ids=lambda c: c.__name__)
def test_no_worker_class_is_more_than_two_levels_below_worker(cls):
    chain = [c.__name__ for c in cls.__mro__[:cls.__mro__.index(Worker)]]
    assert len(chain) <= 2, f"{cls.__name__}: {' -> '.join(reversed(chain))} below Worker"


@pytest.mark.parametrize("cls", _worker_classes(), ids=lambda c: c.__name__)
def test_no_registered_method_is_a_refusal(cls):
    refused = [name for name in registered_methods(cls) if _is_refusal(getattr(cls, name))]
    assert refused == [], f"{cls.__name__} refuses {refused}: a class that cannot serve a method must not have it"


def _copied(klass: type) -> list[str]:
    """Methods of ``klass`` defined elsewhere (a function assigned from another class keeps that
    class's ``__qualname__``)."""
    return [name for name, value in vars(klass).items()
            if inspect.isfunction(value) and not value.__qualname__.startswith(f"{klass.__qualname__}.")]


@pytest.mark.parametrize("cls", _worker_classes(), ids=lambda c: c.__name__)
def test_no_method_is_copied_from_another_class(cls):
    for klass in cls.__mro__[:cls.__mro__.index(Worker)]:
        assert _copied(klass) == [], f"{klass.__name__} holds methods of another class: {_copied(klass)}"


def test_the_checks_see_a_refusal_and_a_copy():
    class Refuser(Worker):
        def refused(self) -> None:
            """Refused."""
            raise RuntimeError("no")

        def unimplemented(self) -> None:
            if self:
                raise NotImplementedError

        def served(self) -> int:
            """Served."""
            return 1

    class Borrower(Worker):
        served = Refuser.served

    assert _is_refusal(Refuser.refused) and _is_refusal(Refuser.unimplemented) and not _is_refusal(Refuser.served)
    assert _copied(Borrower) == ["served"] and _copied(Refuser) == []
