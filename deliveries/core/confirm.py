"""The operator's confirmation before a replay or a cancel, for every kind's admin (the
deliveries' and the background jobs'): one page listing the selection's types, and for a
replay that includes a type not marked replay-safe an extra box to tick, for one row as
for many. The admin action calls ``confirm_operation``; the change itself is the
kind's service, called once the operator confirmed."""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from django.contrib import admin, messages
from django.template.response import TemplateResponse


@dataclass
class Operation:
    """What is confirmed: ``name`` ("replay" or "cancel"), the rows' ``noun`` (singular,
    plural), their ``type_label`` ("event type"), ``explanation`` (HTML, trusted: the
    admin's own text) and, for a replay, ``unsafe_warning``."""

    name: str
    noun: tuple[str, str]
    type_label: str
    explanation: str
    done: str  # "returned to pending"
    unsafe_warning: str = ""


@dataclass
class Selection:
    ids: list
    types: Counter  # type name -> rows
    safe: set[str]
    owners: dict[str, str] = field(default_factory=dict)
    # A selection made by a filter rather than by ticking rows: what the filter is (shown
    # on the page), how many rows matched in all (more than ``ids`` when capped), the rows
    # by state, and what the confirming form carries back instead of the ids.
    described: list[tuple[str, str]] | None = None
    matched: int | None = None
    states: Counter | None = None
    carried: dict[str, str] | None = None


def confirm_operation(
    model_admin,
    request,
    operation: Operation,
    selection: Selection,
    *,
    run: Callable[[list], int],
    back: str,
):
    """The confirmation page, or, once confirmed, ``run(ids)`` and a message saying how
    many of the selection changed. Returns None once done (the action's list follows)."""
    unsafe = sorted(t for t in selection.types if t not in selection.safe)
    needs_extra = operation.name == "replay" and bool(unsafe)
    count = len(selection.ids)
    if request.POST.get("confirm") == "yes":
        if needs_extra and request.POST.get("unsafe_confirmed") != "yes":
            model_admin.message_user(
                request,
                f"Replaying {operation.type_label}s not marked replay-safe needs the extra "
                "confirmation.",
                messages.ERROR,
            )
        else:
            n = run(selection.ids)
            model_admin.message_user(
                request, f"{n} of {count} {operation.noun[1]} {operation.done}.", messages.SUCCESS
            )
            return None
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"Confirm {operation.name}",
        "operation": operation,
        "count": count,
        "noun": operation.noun[0] if count == 1 else operation.noun[1],
        "types": [
            (t, n, t in selection.safe, selection.owners.get(t, ""))
            for t, n in selection.types.most_common()
        ],
        "needs_extra": needs_extra,
        "ids": selection.ids if selection.carried is None else [],
        "carried": sorted((selection.carried or {}).items()),
        "described": selection.described,
        "matched": selection.matched,
        "capped": selection.matched is not None and selection.matched > count,
        "states": sorted((selection.states or {}).items()),
        "action": f"{operation.name}_selected" if selection.carried is None else "",
        "opts": model_admin.model._meta,
        "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        "back": back,
    }
    return TemplateResponse(request, "admin/trusty_jobs/confirm_action.html", context)
