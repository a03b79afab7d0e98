import json

from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError

from ingest.schemes import WEBHOOK_SCHEMES
from ingest.sources import source_create


class Command(BaseCommand):
    help = (
        "Create an inbound source: POST /ingest/<slug>/ verified with the given scheme, or "
        "an smtp source for manage.py run_smtp."
    )

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--scheme", required=True, choices=sorted(WEBHOOK_SCHEMES))
        parser.add_argument(
            "--secret",
            action="append",
            default=[],
            help="Verification secret (user:password for postmark, sendgrid and smtp's "
            "AUTH); repeat for a rotation. Every scheme but smtp needs one.",
        )
        parser.add_argument(
            "--options",
            default="{}",
            help='Scheme options as JSON, e.g. \'{"header": "x-sig"}\' (hmac).',
        )
        parser.add_argument("--tolerance", type=int, default=300)
        parser.add_argument(
            "--max-body-bytes",
            type=int,
            default=None,
            help="Largest body (smtp: message) taken; default 1 MiB, mail schemes more.",
        )

    def handle(self, *args, slug, scheme, secret, options, tolerance, max_body_bytes, **kw):
        if not secret and scheme != "smtp":
            raise CommandError(f"the {scheme} scheme needs --secret")
        sizes = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
        try:
            parsed = json.loads(options)
            source = source_create(
                slug=slug,
                scheme=scheme,
                secrets=secret,
                options=parsed,
                replay_tolerance=tolerance,
                **sizes,
            )
        except (ValueError, TypeError) as exc:
            raise CommandError(str(exc)) from exc
        except IntegrityError as exc:
            raise CommandError(f"a source named {slug!r} exists already") from exc
        if scheme == "smtp":
            self.stdout.write(f"Created source {slug} (smtp): manage.py run_smtp --source {slug}")
        elif scheme == "mailgun":
            # Mailgun posts the raw message only to a URL ending in "mime".
            self.stdout.write(f"Created source {slug} (mailgun): POST /ingest/{slug}/mime")
        else:
            self.stdout.write(f"Created source {source.slug} ({scheme}): POST /ingest/{slug}/")
