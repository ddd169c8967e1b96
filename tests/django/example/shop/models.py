"""The example shop's one model: what its tasks work on."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    total_cents = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"order {self.pk} of {self.customer}"
