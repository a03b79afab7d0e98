import json

from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError

from ingest.schemes import WEBHOOK_SCHEMES
from ingest.sources import source_create


class Command(BaseCommand):
    help = "Create an inbound source: POST /ingest/<slug>/ verified with the given scheme."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--scheme", required=True, choices=sorted(WEBHOOK_SCHEMES))
        parser.add_argument(
            "--secret",
            action="append",
            required=True,
            help="Verification secret; repeat for a rotation.",
        )
        parser.add_argument(
            "--options",
            default="{}",
            help='Scheme options as JSON, e.g. \'{"header": "x-sig"}\' (hmac).',
        )
        parser.add_argument("--tolerance", type=int, default=300)
        parser.add_argument("--max-body-bytes", type=int, default=1024 * 1024)

    def handle(self, *args, slug, scheme, secret, options, tolerance, max_body_bytes, **kw):
        try:
            parsed = json.loads(options)
            source = source_create(
                slug=slug,
                scheme=scheme,
                secrets=secret,
                options=parsed,
                replay_tolerance=tolerance,
                max_body_bytes=max_body_bytes,
            )
        except (ValueError, TypeError) as exc:
            raise CommandError(str(exc)) from exc
        except IntegrityError as exc:
            raise CommandError(f"a source named {slug!r} exists already") from exc
        self.stdout.write(f"Created source {source.slug} ({scheme}): POST /ingest/{slug}/")
