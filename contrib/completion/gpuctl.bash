# bash completion for gpuctl, the client of gpud                    -*- shell-script -*-
#
# Install as /usr/share/bash-completion/completions/gpuctl (or source it from ~/.bashrc).
# Serve and role names come from the daemon itself (`gpuctl serves --names`, `gpuctl ledger`),
# over the socket named on the command line (--socket), else $GPUD_SOCKET, else the default;
# when gpud cannot be reached there is simply nothing to offer.

_gpuctl_commands="status ledger serves admit release start stop restart events reload"
_gpuctl_kinds="admit deny release start healthy exit restart crash-loop stop overdraw
reserve-exceeded reserve-ok reload adopt over-committed"

_gpuctl() {
    local cur prev i word command="" positionals=0
    local -a socket=()
    cur="${COMP_WORDS[COMP_CWORD]}"
    prev="${COMP_WORDS[COMP_CWORD-1]}"

    # Find the command and count its positional arguments before the word being completed.
    for ((i = 1; i < COMP_CWORD; i++)); do
        word="${COMP_WORDS[i]}"
        case "$word" in
            --socket|--timeout|--interval|--since|--limit|--role|--serve)
                [[ "$word" == --socket ]] && socket=(--socket "${COMP_WORDS[i+1]}")
                ((i++)) ;;
            --socket=*) socket=("$word") ;;
            --kind)
                # --kind takes one or more values: skip them
                while ((i + 1 < COMP_CWORD)) && [[ "${COMP_WORDS[i+1]}" != -* ]]; do ((i++)); done ;;
            -*) ;;
            *)
                if [[ -z "$command" ]]; then command="$word"; else ((positionals++)); fi ;;
        esac
    done

    local common="--socket --json --timeout --help"
    case "$prev" in
        --socket) COMPREPLY=($(compgen -f -- "$cur")); return ;;
        --timeout|--interval|--limit) return ;;
        --since) COMPREPLY=($(compgen -W "10m 1h 2h 1d 7d" -- "$cur")); return ;;
        --serve) COMPREPLY=($(compgen -W "$(gpuctl "${socket[@]}" serves --names 2>/dev/null)" -- "$cur")); return ;;
        --role)
            COMPREPLY=($(compgen -W "$(gpuctl "${socket[@]}" ledger 2>/dev/null |
                sed -n "s/^gpu_role '\([^']*\)'.*/\1/p")" -- "$cur"))
            return ;;
    esac
    # --kind K [K ...]: offer kinds while the words after --kind are kinds
    if [[ "$command" == events && "$cur" != -* ]]; then
        for ((i = COMP_CWORD - 1; i > 0; i--)); do
            word="${COMP_WORDS[i]}"
            if [[ "$word" == --kind ]]; then
                COMPREPLY=($(compgen -W "$_gpuctl_kinds" -- "$cur")); return
            fi
            [[ "$word" == -* ]] && break
        done
    fi

    if [[ -z "$command" ]]; then
        if [[ "$cur" == -* ]]; then
            COMPREPLY=($(compgen -W "$common --version" -- "$cur"))
        else
            COMPREPLY=($(compgen -W "$_gpuctl_commands" -- "$cur"))
        fi
        return
    fi

    local options="" names=""
    case "$command" in
        status|reload) ;;
        ledger) options="--watch --interval" ;;
        serves) options="--names"; ((positionals == 0)) && names=1 ;;
        admit) options="--role"; ((positionals == 0)) && names=1 ;;
        release) options="--stop"; ((positionals == 0)) && names=1 ;;
        start|stop|restart) ((positionals == 0)) && names=1 ;;
        events) options="--serve --role --kind --since --limit --follow" ;;
        *) return ;;
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$options $common" -- "$cur"))
    elif [[ -n "$names" ]]; then
        COMPREPLY=($(compgen -W "$(gpuctl "${socket[@]}" serves --names 2>/dev/null)" -- "$cur"))
    fi
}

complete -F _gpuctl gpuctl
