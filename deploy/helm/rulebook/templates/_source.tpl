{{/* The rules source's flags, mounts, volumes and (git-sync) sidecar, by rulesSource. */}}

{{- define "rulebook.sourceArgs" -}}
{{- if eq .Values.rulesSource "configmap" -}}
- --rules=/etc/rulebook/rules
- --templates=/etc/rulebook/templates
{{- else if eq .Values.rulesSource "gitSync" -}}
- --rules=/git/current/{{ .Values.gitSync.rulesPath }}
- --templates=/git/current/{{ .Values.gitSync.templatesPath }}
{{- else -}}
{{- with .Values.git -}}
- --rules-git={{ .url }}
{{- /* the emptyDir "git" below: the root filesystem is read-only */}}
- --git-cache-dir=/var/lib/rulebook/git
{{- with .ref }}
- --git-ref={{ . }}
{{- end }}
{{- with .path }}
- --git-path={{ . }}
{{- end }}
{{- with .templatesPath }}
- --git-templates-path={{ . }}
{{- end }}
{{- with .interval }}
- --git-interval={{ . }}
{{- end }}
{{- with .tokenFile }}
- --git-token-file={{ . }}
{{- end }}
{{- with .tokenUser }}
- --git-token-user={{ . }}
{{- end }}
{{- with .sshKeyFile }}
- --git-ssh-key={{ . }}
{{- end }}
{{- with .sshKnownHostsFile }}
- --git-ssh-known-hosts={{ . }}
{{- end }}
{{- with .hookSecretFile }}
- --git-hook-secret-file={{ . }}
{{- end }}
{{- if .allowedSignersConfigMap }}
- --git-verify=/etc/rulebook/git-verify/allowed_signers
{{- end }}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rulebook.sourceMounts" -}}
{{- if eq .Values.rulesSource "configmap" -}}
- name: rules
  mountPath: /etc/rulebook/rules
  readOnly: true
- name: templates
  mountPath: /etc/rulebook/templates
  readOnly: true
{{- else if eq .Values.rulesSource "gitSync" -}}
- name: git
  mountPath: /git
  readOnly: true
{{- else -}}
# the git source's checkouts
- name: git
  mountPath: /var/lib/rulebook/git
{{- if .Values.git.authSecret }}
- name: git-auth
  mountPath: /etc/rulebook/git-auth
  readOnly: true
{{- end }}
{{- if .Values.git.allowedSignersConfigMap }}
- name: git-verify
  mountPath: /etc/rulebook/git-verify
  readOnly: true
{{- end }}
{{- end -}}
{{- end -}}

{{- define "rulebook.sourceVolumes" -}}
{{- $name := include "rulebook.fullname" . -}}
{{- if eq .Values.rulesSource "configmap" -}}
# ConfigMap keys cannot contain '/': each file's key is its path with '/' → '__', and
# `items` map the keys back to the paths (as deploy/sync-ruleset.sh does).
- name: rules
  configMap:
    name: {{ $name }}-rules
    defaultMode: 292 # 0444
    items:
      {{- range $path, $_ := .Values.ruleset.rules }}
      - key: {{ replace "/" "__" $path | quote }}
        path: {{ $path | quote }}
      {{- end }}
- name: templates
  configMap:
    name: {{ $name }}-templates
    defaultMode: 292
    {{- with .Values.ruleset.templates }}
    items:
      {{- range $path, $_ := . }}
      - key: {{ replace "/" "__" $path | quote }}
        path: {{ $path | quote }}
      {{- end }}
    {{- end }}
{{- else if eq .Values.rulesSource "gitSync" -}}
- name: git
  emptyDir:
    sizeLimit: 256Mi
- name: git-sync-tmp
  emptyDir:
    sizeLimit: 16Mi
{{- else -}}
- name: git
  emptyDir:
    sizeLimit: 256Mi
{{- with .Values.git.authSecret }}
- name: git-auth
  secret:
    secretName: {{ . }}
    defaultMode: 256 # 0400
{{- end }}
{{- with .Values.git.allowedSignersConfigMap }}
- name: git-verify
  configMap:
    name: {{ . }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "rulebook.gitSync" -}}
- name: git-sync
  image: {{ .Values.gitSync.image }}
  imagePullPolicy: IfNotPresent
  restartPolicy: Always
  args:
    - --repo={{ .Values.gitSync.repo }}
    - --ref={{ .Values.gitSync.ref }}
    - --root=/git
    - --link=current
    - --period={{ .Values.gitSync.period }}
    - --depth=1
    - --max-failures=-1
    - --http-bind=:8081
  ports:
    - name: git-sync
      containerPort: 8081
      protocol: TCP
  startupProbe:
    httpGet:
      path: /
      port: git-sync
    periodSeconds: 2
    failureThreshold: 150
  resources:
    requests: {cpu: 10m, memory: 32Mi}
    limits: {cpu: 500m, memory: 256Mi}
  securityContext:
    runAsNonRoot: true
    runAsUser: 65533
    runAsGroup: 65533
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    capabilities:
      drop: [ALL]
  volumeMounts:
    - name: git
      mountPath: /git
    - name: git-sync-tmp
      mountPath: /tmp
{{- end -}}
