{{- define "inferline.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inferline.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "inferline.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "inferline.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* selectorLabels: (dict "root" $ "component" "worker") */}}
{{- define "inferline.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inferline.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "inferline.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "inferline.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "inferline.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* A setting's value, or the program's default: (dict "root" $ "section" "http" "key" "port" "default" 8080) */}}
{{- define "inferline.setting" -}}
{{- $section := index .root.Values.settings .section | default dict -}}
{{- $value := index $section .key -}}
{{- if kindIs "invalid" $value }}{{ .default }}{{ else }}{{ $value }}{{ end -}}
{{- end -}}

{{- define "inferline.httpPort" -}}
{{- include "inferline.setting" (dict "root" . "section" "http" "key" "port" "default" 8080) | int -}}
{{- end -}}

{{- define "inferline.gatewayPort" -}}
{{- include "inferline.setting" (dict "root" . "section" "gateway" "key" "port" "default" 8000) | int -}}
{{- end -}}

{{- define "inferline.intake" -}}
{{- include "inferline.setting" (dict "root" . "section" "kafka" "key" "intake" "default" "group") -}}
{{- end -}}

{{/* The environment variables of a settings map, as a JSON object name -> string (sorted by name).
     (dict "prefix" "INFERLINE" "values" .Values.settings) */}}
{{- define "inferline.flattenSettings" -}}
{{- $out := dict -}}
{{- $asJson := list "INFERLINE_LIMITS__TENANTS" "INFERLINE_GATEWAY__API_KEYS" "INFERLINE_KAFKA__LIBRDKAFKA" "INFERLINE_KAFKA__AIOKAFKA" "INFERLINE_KAFKA__OAUTH_EXTENSIONS" -}}
{{- range $key, $value := .values -}}
{{- $name := ternary (printf "INFERLINE_%s" (upper $key)) (printf "%s__%s" $.prefix (upper $key)) (eq $.prefix "INFERLINE") -}}
{{- if kindIs "invalid" $value -}}
{{- else if and (kindIs "map" $value) (not (has $name $asJson)) -}}
{{- $out = merge $out (include "inferline.flattenSettings" (dict "prefix" $name "values" $value) | fromJson) -}}
{{- else if kindIs "string" $value -}}
{{- $_ := set $out $name $value -}}
{{- else if and (kindIs "map" $value) (empty $value) -}}
{{- else -}}
{{- $_ := set $out $name (toJson $value) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Names the chart sets itself (from Secrets and the pod), never from a literal setting. */}}
{{- define "inferline.chartOwnedEnv" -}}
{{- $owned := list "INFERLINE_KAFKA__SASL_PASSWORD" "INFERLINE_KAFKA__OAUTH_CLIENT_SECRET" "INFERLINE_GATEWAY__API_KEYS" -}}
{{- if .Values.workers.staticMembership }}{{ $owned = append $owned "INFERLINE_KAFKA__GROUP_INSTANCE_ID" }}{{ end -}}
{{- toJson $owned -}}
{{- end -}}

{{- define "inferline.chartSecretName" -}}
{{- printf "%s-secrets" (include "inferline.fullname" .) -}}
{{- end -}}

{{/* True when the chart makes the Secret holding kafka.sasl_password (a literal in values). */}}
{{- define "inferline.saslSecretName" -}}
{{- if .Values.kafkaAuth.passwordSecret.name -}}
{{- .Values.kafkaAuth.passwordSecret.name -}}
{{- else if .Values.settings.kafka.sasl_password -}}
{{- include "inferline.chartSecretName" . -}}
{{- end -}}
{{- end -}}

{{- define "inferline.saslSecretKey" -}}
{{- if .Values.kafkaAuth.passwordSecret.name }}{{ .Values.kafkaAuth.passwordSecret.key }}{{ else }}sasl-password{{ end -}}
{{- end -}}

{{/* The Secret holding the OAUTHBEARER client secret: kafkaAuth.oauthSecret, or the chart's. */}}
{{- define "inferline.oauthSecretName" -}}
{{- if .Values.kafkaAuth.oauthSecret.name -}}
{{- .Values.kafkaAuth.oauthSecret.name -}}
{{- else if .Values.settings.kafka.oauth_client_secret -}}
{{- include "inferline.chartSecretName" . -}}
{{- end -}}
{{- end -}}

{{- define "inferline.oauthSecretKey" -}}
{{- if .Values.kafkaAuth.oauthSecret.name }}{{ .Values.kafkaAuth.oauthSecret.key }}{{ else }}oauth-client-secret{{ end -}}
{{- end -}}

{{/* The env list shared by the worker, the gateway and the topics Job: every setting that is set,
     then the files of the mounted Secrets. */}}
{{- define "inferline.env" -}}
{{- $owned := include "inferline.chartOwnedEnv" . | fromJsonArray -}}
{{- $env := include "inferline.flattenSettings" (dict "prefix" "INFERLINE" "values" .Values.settings) | fromJson -}}
{{- $mounted := dict -}}
{{- if include "inferline.saslSecretName" . }}{{ $_ := set $mounted "INFERLINE_KAFKA__SASL_PASSWORD_FILE" "a password Secret" }}{{ end -}}
{{- if include "inferline.oauthSecretName" . }}{{ $_ := set $mounted "INFERLINE_KAFKA__OAUTH_CLIENT_SECRET_FILE" "an OAuth client secret" }}{{ end -}}
{{- if .Values.kafkaAuth.tlsSecret.name }}
{{- range $n := list "INFERLINE_KAFKA__SSL_CAFILE" "INFERLINE_KAFKA__SSL_CERTFILE" "INFERLINE_KAFKA__SSL_KEYFILE" }}{{ $_ := set $mounted $n "kafkaAuth.tlsSecret" }}{{ end }}
{{- end -}}
{{- if or .Values.gateway.apiKeysSecret.name .Values.settings.gateway.api_keys }}{{ $_ := set $mounted "INFERLINE_GATEWAY__API_KEYS_FILE" "an API keys Secret" }}{{ end -}}
{{- range $name, $source := $mounted }}
{{- if hasKey $env $name }}
{{- fail (printf "%s is set both in settings and by the chart from %s: keep one" $name $source) }}
{{- end }}
{{- end }}
{{- range $name, $value := $env }}
{{- if not (has $name $owned) }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
- name: INFERLINE_CACHE_DIR
  value: /var/cache/inferline
{{- if include "inferline.saslSecretName" . }}
- name: INFERLINE_KAFKA__SASL_PASSWORD_FILE
  value: /etc/inferline/kafka-sasl/password
{{- end }}
{{- if include "inferline.oauthSecretName" . }}
- name: INFERLINE_KAFKA__OAUTH_CLIENT_SECRET_FILE
  value: /etc/inferline/kafka-oauth/client-secret
{{- end }}
{{- with .Values.kafkaAuth.tlsSecret }}
{{- if .name }}
{{- if .caKey }}
- name: INFERLINE_KAFKA__SSL_CAFILE
  value: /etc/inferline/kafka-tls/ca.crt
{{- end }}
{{- if .certKey }}
- name: INFERLINE_KAFKA__SSL_CERTFILE
  value: /etc/inferline/kafka-tls/tls.crt
{{- end }}
{{- if .keyKey }}
- name: INFERLINE_KAFKA__SSL_KEYFILE
  value: /etc/inferline/kafka-tls/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "inferline.kafkaVolumeMounts" -}}
- name: model-cache
  mountPath: /var/cache/inferline
{{- if include "inferline.saslSecretName" . }}
- name: kafka-sasl
  mountPath: /etc/inferline/kafka-sasl
  readOnly: true
{{- end }}
{{- if include "inferline.oauthSecretName" . }}
- name: kafka-oauth
  mountPath: /etc/inferline/kafka-oauth
  readOnly: true
{{- end }}
{{- if .Values.kafkaAuth.tlsSecret.name }}
- name: kafka-tls
  mountPath: /etc/inferline/kafka-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The Secret volumes (the model cache is each workload's own). */}}
{{- define "inferline.kafkaVolumes" -}}
{{- if include "inferline.saslSecretName" . }}
- name: kafka-sasl
  secret:
    secretName: {{ include "inferline.saslSecretName" . }}
    items:
      - key: {{ include "inferline.saslSecretKey" . }}
        path: password
{{- end }}
{{- if include "inferline.oauthSecretName" . }}
- name: kafka-oauth
  secret:
    secretName: {{ include "inferline.oauthSecretName" . }}
    items:
      - key: {{ include "inferline.oauthSecretKey" . }}
        path: client-secret
{{- end }}
{{- with .Values.kafkaAuth.tlsSecret }}
{{- if .name }}
- name: kafka-tls
  secret:
    secretName: {{ .name }}
    items:
      {{- if .caKey }}
      - key: {{ .caKey }}
        path: ca.crt
      {{- end }}
      {{- if .certKey }}
      - key: {{ .certKey }}
        path: tls.crt
      {{- end }}
      {{- if .keyKey }}
      - key: {{ .keyKey }}
        path: tls.key
      {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Seconds from SIGTERM to SIGKILL: above the drain timeout, with the revocation wait (half the
     session timeout) and 10 s to commit and leave. */}}
{{- define "inferline.terminationGrace" -}}
{{- $drain := include "inferline.setting" (dict "root" . "section" "worker" "key" "drain_timeout_s" "default" 30) | float64 -}}
{{- $session := include "inferline.setting" (dict "root" . "section" "kafka" "key" "session_timeout_ms" "default" 10000) | float64 -}}
{{- $grace := .Values.workers.terminationGracePeriodSeconds -}}
{{- if kindIs "invalid" $grace -}}
{{- $grace = add (ceil $drain | int) (ceil (divf $session 2000.0) | int) 10 -}}
{{- end -}}
{{- if le (float64 $grace) $drain -}}
{{- fail (printf "workers.terminationGracePeriodSeconds (%v) must exceed settings.worker.drain_timeout_s (%v): the drain would be killed" $grace $drain) -}}
{{- end -}}
{{- $grace | int -}}
{{- end -}}

{{/* PromQL label matchers of this release's worker pods. */}}
{{- define "inferline.workerSelector" -}}
{{- if .Values.autoscaling.prometheus.selector -}}
{{- .Values.autoscaling.prometheus.selector -}}
{{- else -}}
namespace="{{ .Release.Namespace }}",pod=~"{{ include "inferline.fullname" . }}-worker-[0-9]+"
{{- end -}}
{{- end -}}
