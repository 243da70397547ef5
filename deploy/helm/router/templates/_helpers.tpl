{{/* The labels every object carries, as the kustomize base writes them. */}}
{{- define "router.labels" -}}
app.kubernetes.io/name: router
{{- end -}}
