from django.db import models


class Invoice(models.Model):
    number = models.CharField(max_length=20, unique=True)
    amount_cents = models.PositiveIntegerField()

    def __str__(self) -> str:
        return self.number
