from django.http import JsonResponse

from shop.tasks import recalculate_totals


def recalculate(request, customer):
    """Queue a recalculation; a second click while one waits gets the same job."""
    result = recalculate_totals.delay(customer)
    return JsonResponse({"job": result.id, "duplicate": result.duplicate})
