from django.urls import path
from shop import views

urlpatterns = [path("recalculate/<str:customer>/", views.recalculate)]
