from django.urls import include, path

# A host's URLconf: the one include() that mounts everything the apps serve.
urlpatterns = [path("", include("deliveries.urls"))]
