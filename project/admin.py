"""The standalone service's own admin: its staff users and groups, whose adds, edits and
deletions are audited like the products' (deliveries.core.console.AuditedEdits). A host
project keeps its own user admin."""

from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User

from deliveries.core.console import AuditedEdits, ConsoleAdmin


class ConsoleUserAdmin(AuditedEdits, ConsoleAdmin, UserAdmin):
    pass


class ConsoleGroupAdmin(AuditedEdits, ConsoleAdmin, GroupAdmin):
    pass


for _model, _model_admin in [(User, ConsoleUserAdmin), (Group, ConsoleGroupAdmin)]:
    admin.site.unregister(_model)
    admin.site.register(_model, _model_admin)
